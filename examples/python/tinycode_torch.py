#!/usr/bin/env python3
"""KV-cache eviction with kvevict in a PyTorch model: the vendored tinycode model, end to end.

A plain float32 PyTorch forward pass of models/tinycode (a byte-level Llama-style model, see its MODEL.md) that
follows the C++ demo's continuation-loss protocol in oneshot mode (examples/kvevict_demo.cpp):

  1. prefill the doc's first 1536 bytes with the full cache (full causal attention);
  2. hand every layer's keys, values, the post-RoPE queries of the last 32 context positions and W_o to
     kvevict.select_layers(policy, ..., keep=R), which keeps floor(R * 1536) rows per KV head on average
     (window included), and drop the other rows of each (layer, KV head) cache;
  3. run bytes 1536..2046 teacher-forced on the compressed cache (one chunk: each token sees the kept context rows
     of its KV head and the continuation tokens up to itself, at their original RoPE positions);
  4. loss = mean NLL (nats/byte) of bytes 1536..2047; byte 1536 is predicted by the prefill's last position.

Only torch, numpy and the standard library; `--policy full` needs no kvevict module at all.

`--tensor-parallel N` runs the same protocol on N processes (torch.distributed, gloo backend) that split the KV heads
as a tensor-parallel engine does: each rank attends with its KV heads (and their query heads), multiplies by its
columns of W_o and all-reduces; each rank's cache holds its heads only, and kvevict.select_layers(..., shard=...)
evicts them exactly as the one-process call would (docs/algorithms.md#sharded), over a communicator whose
all_gather is torch.distributed.all_gather.
"""
import argparse
import json
import math
import os
import socket
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

CONTEXT, TOTAL, DOC_BYTES = 1536, 2048, 2560  # examples/tinycode/eval.hpp (ContinuationTask, load_docs)
WINDOW = 32  # the demo's eviction window: queries of the last 32 context positions
ATTENTION_BLOCK = 256  # query rows per attention block
HERE = os.path.dirname(os.path.abspath(__file__))


def linear(x, w):
    """x [n, k] times w [m, k] transposed (PyTorch Linear layout). Debian's python3-torch multiplies through the
    reference BLAS, about 20x slower than oneDNN's gemm, so go through oneDNN tensors when torch has it (float32
    either way; only the summation order differs)."""
    if not torch.backends.mkldnn.is_available():
        return x @ w.T
    return torch.nn.functional.linear(x.contiguous().to_mkldnn(), w.contiguous().to_mkldnn()).to_dense()


# ---- weights ----------------------------------------------------------------------------------------------------

def read_safetensors(path):
    """{name: numpy array} of a safetensors file: u64 LE header length, JSON header, then the raw tensor bytes."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header, base = json.loads(blob[8:8 + n]), 8 + n
    dtypes = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4", "U8": "u1"}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = blob[base + start:base + end]
        if info["dtype"] == "BF16":  # bfloat16 = the high half of a float32
            arr = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, dtypes[info["dtype"]])
        out[name] = arr.reshape(info["shape"])
    return out


class TinyCode:
    """Config and float32 weights (converted once from float16, as examples/tinycode/model.hpp does)."""

    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        self.n_layer, self.n_head, self.n_kv = c["n_layer"], c["n_head"], c["n_kv_head"]
        self.d, self.eps, self.vocab = c["head_dim"], c["norm_eps"], c["vocab"]
        self.group = self.n_head // self.n_kv  # GQA: query head j uses KV head j // group
        w = read_safetensors(os.path.join(model_dir, "model.safetensors"))
        t = lambda name: torch.from_numpy(w[name].astype(np.float32))
        self.embed, self.final_norm = t("embed.weight"), t("final_norm.weight")  # embed is also the (tied) head
        names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
        self.layers = [{k: t(f"layers.{i}.{k}.weight") for k in names} for i in range(self.n_layer)]
        # RoPE table [ctx, d/2], rotate-half: angle(t, m) = t * theta^(-2m/d), in double, stored as float (engine.hpp)
        half = self.d // 2
        angle = np.arange(c["ctx"], dtype=np.float64)[:, None] * c["rope_theta"] ** (-2.0 * np.arange(half) / self.d)
        self.cos = torch.from_numpy(np.cos(angle).astype(np.float32))
        self.sin = torch.from_numpy(np.sin(angle).astype(np.float32))

    def rms_norm(self, x, gain):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * gain

    def rope(self, x, positions):
        """x [n, heads, d] rotated at `positions` [n], rotate-half pairs (m, m + d/2) (kvevict: RopeLayout::half)."""
        half = self.d // 2
        c, s = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


# ---- cache and forward pass ---------------------------------------------------------------------------------------

class KVCache:
    """Per (layer, KV head) post-RoPE keys and values [length, d]. After eviction the heads of a layer may hold
    different numbers of rows (AdaKV, DefensiveKV...), hence one tensor per head; rows stay in position order."""

    def __init__(self, model):
        self.k = [[torch.zeros(0, model.d) for _ in range(model.n_kv)] for _ in range(model.n_layer)]
        self.v = [[torch.zeros(0, model.d) for _ in range(model.n_kv)] for _ in range(model.n_layer)]
        self.window_q = [None] * model.n_layer  # per layer: post-RoPE queries of the last WINDOW positions [H, w, d]


def attention(q, keys, values, cached):
    """Causal attention of n new tokens: q [G, n, d] (the G query heads of one KV head), keys / values
    [cached + n, d]. New token i sees every cached row and the new tokens 0..i. Returns [G, n, d]. Query rows go in
    blocks (as engine.hpp does): bounds the score buffer and skips most of the causal triangle."""
    G, n, d = q.shape
    out = torch.empty(G, n, d)
    for b0 in range(0, n, ATTENTION_BLOCK):
        bn = min(ATTENTION_BLOCK, n - b0)
        end = cached + b0 + bn  # keys visible to the block's last row
        scores = linear(q[:, b0:b0 + bn].reshape(G * bn, d), keys[:end]).view(G, bn, end) / math.sqrt(d)
        visible = torch.ones(bn, end, dtype=torch.bool).tril(diagonal=cached + b0)  # row i: keys j <= cached + b0 + i
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[:, b0:b0 + bn] = linear(probs.view(G * bn, end), values[:end].T).view(G, bn, d)
    return out


class TensorParallel:
    """This process's share of the KV heads (contiguous, as engines split them) among `size` gloo ranks; size 1:
    every head, no communication."""

    def __init__(self, model, rank=0, size=1):
        self.rank, self.size = rank, size
        per = model.n_kv // size
        self.kv_heads = list(range(rank * per, (rank + 1) * per))

    def all_reduce(self, x):
        if self.size > 1:
            dist.all_reduce(x)
        return x


class GlooCommunicator:
    """kvevict's communicator (docs/algorithms.md#sharded) over torch.distributed: all_gather of bytes, rank order."""

    def __init__(self):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def all_gather(self, data):
        mine = torch.tensor(list(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine)
        return b"".join(bytes(t.numpy()) for t in out)


def extend(model, cache, tokens, first_pos, tp=None):
    """Runs `tokens` (LongTensor [n]) at positions first_pos .. first_pos + n - 1 on `cache` (appending their keys
    and values); returns logits [n, vocab] (row i predicts the token after tokens[i]). On an empty cache this is the
    prefill; on a compressed cache it is n teacher-forced decoding steps (Engine::extend in engine.hpp). With `tp`
    (TensorParallel) only its KV heads attend, and their share of the output projection is all-reduced."""
    n, d, G = tokens.shape[0], model.d, model.group
    tp = tp or TensorParallel(model)
    pos = torch.arange(first_pos, first_pos + n)
    x = model.embed[tokens]  # [n, d_model]
    for l, w in enumerate(model.layers):
        h = model.rms_norm(x, w["attn_norm"])
        q = model.rope(linear(h, w["wq"]).view(n, model.n_head, d), pos)  # [n, H, d]
        k = model.rope(linear(h, w["wk"]).view(n, model.n_kv, d), pos)    # [n, Hkv, d]
        v = linear(h, w["wv"]).view(n, model.n_kv, d)
        if n >= WINDOW:  # remember the window queries for eviction (only the prefill's are used here)
            cache.window_q[l] = q[-WINDOW:].permute(1, 0, 2).contiguous()  # [H, w, d], oldest first
        out = torch.empty(n, model.n_head, d)
        for kh in tp.kv_heads:
            keys = torch.cat([cache.k[l][kh], k[:, kh]])  # [cached + n, d]: kept rows, then the new tokens
            values = torch.cat([cache.v[l][kh], v[:, kh]])
            cache.k[l][kh], cache.v[l][kh] = keys, values
            heads = slice(kh * G, (kh + 1) * G)  # the query heads sharing this KV head (GQA)
            out[:, heads] = attention(q[:, heads].permute(1, 0, 2), keys, values, keys.shape[0] - n).permute(1, 0, 2)
        # heads concatenated: head j is columns j*d .. j*d+d-1 of W_o (tensor parallel: this rank's heads' columns)
        cols = slice(tp.kv_heads[0] * G * d, (tp.kv_heads[-1] + 1) * G * d)
        x = x + tp.all_reduce(linear(out.view(n, -1)[:, cols], w["wo"][:, cols]))
        h = model.rms_norm(x, w["mlp_norm"])
        x = x + linear(torch.nn.functional.silu(linear(h, w["w_gate"])) * linear(h, w["w_up"]), w["w_down"])
    return linear(model.rms_norm(x, model.final_norm), model.embed)


# ---- eviction ---------------------------------------------------------------------------------------------------

def evict(kvevict, model, cache, policy, keep, tp):
    """Compresses every layer with one kvevict.select_layers call, as the demo does: per-layer policies select
    layer by layer, layer-global ones (layer-defensivekv) split the budget across layers jointly. Tensor parallel:
    each rank passes its KV heads, their query heads and W_o columns, and the shard."""
    heads, G, d = tp.kv_heads, model.group, model.d
    qs, cols = slice(heads[0] * G, (heads[-1] + 1) * G), slice(heads[0] * G * d, (heads[-1] + 1) * G * d)
    inputs = [dict(keys=torch.stack([cache.k[l][h] for h in heads]),    # [Hkv, L, d] (layout "heads"); L = 1536 now
                   values=torch.stack([cache.v[l][h] for h in heads]),  # [Hkv, L, d]
                   q_window=cache.window_q[l][qs],                      # [H, 32, d], post-RoPE
                   w_o=model.layers[l]["wo"][:, cols].contiguous())     # [d_model, H * d], for value-aware policies
              for l in range(model.n_layer)]
    # positions default to 0 .. L-1, the original positions of a freshly prefilled cache
    shard = None if tp.size == 1 else dict(comm=GlooCommunicator(), layer_group=GlooCommunicator(),
                                           layers=list(range(model.n_layer)), kv_heads=heads)
    selections = kvevict.select_layers(policy, inputs, keep=keep, shard=shard)
    for l, sel in enumerate(selections):
        for i, h in enumerate(heads):
            rows = torch.from_numpy(sel.head(i))  # kept rows of KV head h, ascending
            cache.k[l][h], cache.v[l][h] = cache.k[l][h][rows], cache.v[l][h][rows]


def continuation_loss(model, doc, policy, keep, kvevict=None, tp=None):
    """The demo's oneshot protocol on one doc (eval.hpp ContinuationTask); returns (loss, kept rows per head of
    this rank)."""
    tp = tp or TensorParallel(model)
    context, continuation = doc[:CONTEXT], doc[CONTEXT:TOTAL]
    cache = KVCache(model)
    context_logits = extend(model, cache, context, 0, tp)  # full attention over the 1536-byte context
    if policy != "full":
        evict(kvevict, model, cache, policy, keep, tp)
    kept = [cache.k[l][h].shape[0] for l in range(model.n_layer) for h in tp.kv_heads]
    after_logits = extend(model, cache, continuation[:-1], CONTEXT, tp)  # bytes 1536..2046 at original positions
    # predictions of bytes 1536..2047: the prefill's last row, then the compressed cache's rows; NLL in double
    logits = torch.cat([context_logits[-1:], after_logits]).double()
    nll = -logits.log_softmax(-1).gather(1, continuation[:, None]).squeeze(1)
    return nll.mean().item(), kept


# ---- references and main ----------------------------------------------------------------------------------------

def reference_losses(path, policy, keep):
    """Per-doc losses of `policy` at `keep` from a kvevict-demo --json file (the oneshot, default-layout record), or
    the 'after_prefix' losses of eval/full_cache_nll.json (which only holds the full cache)."""
    with open(path) as f:
        ref = json.load(f)
    if isinstance(ref, dict):  # full_cache_nll.json
        if policy != "full":
            sys.exit(f"{path} holds full-cache losses only; use it with --policy full")
        return [doc["after_prefix"] for doc in ref["docs"]]
    default_layout = dict(mode="oneshot", share="head", block=1, renumber=False)
    for r in ref:
        if r["policy"] == policy and (policy == "full" or abs(r["keep"] - keep) < 1e-9) and \
                all(r.get(k, v) == v for k, v in default_layout.items()):
            return r["doc_losses"]
    sys.exit(f"{path}: no oneshot default-layout record for policy {policy} at keep {keep}")


def run(args, tp_rank=0, port=0):
    """The protocol on this process (tensor-parallel rank tp_rank of args.tensor_parallel); rank 0 reports."""
    torch.set_num_threads(args.threads)
    if args.tensor_parallel > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=tp_rank,
                                world_size=args.tensor_parallel)
    say = print if tp_rank == 0 else (lambda *a, **k: None)
    kvevict = None
    if args.policy != "full":
        try:
            import kvevict  # this repo's Python module (README.md: PYTHONPATH=build/<preset>/python)
        except ImportError as e:
            sys.exit(f"{e}: build it with -DKVEVICT_BUILD_PYTHON=ON and put build/<preset>/python on PYTHONPATH")
        if args.policy not in kvevict.policies():
            sys.exit(f"unknown policy {args.policy!r}; kvevict.policies(): {', '.join(kvevict.policies())}")
    model = TinyCode(args.model)
    if model.n_kv % args.tensor_parallel != 0:
        sys.exit(f"--tensor-parallel {args.tensor_parallel} must divide the model's {model.n_kv} KV heads")
    tp = TensorParallel(model, tp_rank, args.tensor_parallel)
    with open(os.path.join(args.model, "eval", "docs.bin"), "rb") as f:
        blob = np.frombuffer(f.read(), np.uint8)
    docs = torch.from_numpy(blob.astype(np.int64)).view(-1, DOC_BYTES)[:args.docs]
    ref = reference_losses(args.check_against, args.policy, args.keep) if args.check_against else None
    if ref is not None and len(ref) < len(docs):
        sys.exit(f"{args.check_against} holds {len(ref)} docs, fewer than --docs {len(docs)}")

    label = "full cache" if args.policy == "full" else f"{args.policy}, keep {args.keep} " \
        f"(n_kept = {int(math.floor(args.keep * CONTEXT))} of {CONTEXT} per KV head)"
    parallel = f", KV heads over {tp.size} gloo ranks" if tp.size > 1 else ""
    say(f"tinycode continuation loss, {label}, {len(docs)} docs{parallel}")
    losses, diffs, t0 = [], [], time.time()
    with torch.no_grad():
        for i, doc in enumerate(docs):
            loss, kept = continuation_loss(model, doc, args.policy, args.keep, kvevict, tp)
            if tp.size > 1:  # every rank's heads
                every = [None] * tp.size
                dist.all_gather_object(every, kept)
                kept = [k for rank in every for k in rank]
            losses.append(loss)
            line = f"doc {i:2d}  loss {loss:.6f}  kept/head {min(kept)}..{max(kept)} (mean {np.mean(kept):.1f})"
            if ref is not None:
                diffs.append(abs(loss - ref[i]))
                line += f"  reference {ref[i]:.6f}  diff {loss - ref[i]:+.2e}"
            say(line, flush=True)
    say(f"mean loss {np.mean(losses):.6f} over {len(losses)} docs ({time.time() - t0:.1f} s)")
    if ref is not None:
        # The C++ engine and this script differ only in float32 summation order: per-doc losses agree to < 1e-6
        # (all 8 policies x 3 keeps). A protocol slip moves them by more than 1e-4 on most docs (keeping 1 row
        # fewer per head: 5e-5 .. 4e-4; a 31-query window: 1e-3 .. 4e-3), so 1e-4 catches it with room for noise.
        # Tensor parallel adds one more order (the ranks' shares of the output projection summed by all_reduce).
        say(f"max abs diff vs {args.check_against}: {max(diffs):.3e} (tolerance {args.tol:g})")
        if max(diffs) > args.tol:
            say("MISMATCH", file=sys.stderr)
            return 1
    return 0


def worker(tp_rank, args, port):
    code = run(args, tp_rank, port)
    dist.destroy_process_group()
    if code:
        sys.exit(code)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(HERE, "..", "..", "models", "tinycode"))
    ap.add_argument("--policy", default="full", help="a kvevict.policies() name, or full (no eviction)")
    ap.add_argument("--keep", type=float, default=0.1, help="keep ratio: floor(keep * 1536) rows per KV head")
    ap.add_argument("--docs", type=int, default=4, help="the first N of the 64 eval docs")
    ap.add_argument("--check-against", metavar="FILE.json", help="exit 1 unless per-doc losses match FILE")
    ap.add_argument("--tol", type=float, default=1e-4, help="absolute per-doc tolerance of --check-against")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="split the KV heads over N processes (torch.distributed, gloo)")
    args = ap.parse_args()
    if args.tensor_parallel < 1:
        sys.exit(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.tensor_parallel == 1:
        return run(args)
    with socket.socket() as s:  # a free local port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        torch.multiprocessing.spawn(worker, args=(args, port), nprocs=args.tensor_parallel)
    except torch.multiprocessing.ProcessExitedException as e:
        print(f"a rank failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
