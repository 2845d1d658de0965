# select_layers(..., shard=...): this rank's part of a sharded model (docs/algorithms.md#sharded) through the C API's
# communicator callbacks. Ranks are Python threads here (the GIL is released while selecting; each all_gather takes it
# back), exchanging through a barrier: every rank keeps exactly what one select_layers call over the model keeps.

import threading

import numpy as np
import pytest

import kvevict


class ThreadGroup:
    """The state the ranks of one run share: all_gather is a slot per rank between two barriers."""

    def __init__(self, size):
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size, timeout=60)

    def comm(self, rank):
        group = self

        class Comm:
            def __init__(self):
                self.rank, self.size = rank, group.size

            def all_gather(self, data):
                group.slots[rank] = bytes(data)
                group.barrier.wait()
                out = b"".join(group.slots)
                group.barrier.wait()
                return out

        return Comm()


def random_model(rng, layers=3, Hkv=2, G=2, L=48, w=4, d=8, D=16):
    return [dict(keys=rng.standard_normal((Hkv, L, d)).astype(np.float32),
                 values=rng.standard_normal((Hkv, L, d)).astype(np.float32),
                 q_window=rng.standard_normal((Hkv * G, w, d)).astype(np.float32),
                 w_o=rng.standard_normal((D, Hkv * G * d)).astype(np.float32)) for _ in range(layers)]


def part(layer, heads, G):
    """KV heads `heads` (contiguous) of a layer: their keys and values, their G query heads and W_o columns."""
    h0, n, d = heads[0], len(heads), layer["keys"].shape[2]
    return dict(keys=layer["keys"][h0:h0 + n], values=layer["values"][h0:h0 + n],
                q_window=layer["q_window"][h0 * G:(h0 + n) * G],
                w_o=np.ascontiguousarray(layer["w_o"][:, h0 * G * d:(h0 + n) * G * d]))


def run_split(model, policy, tp, pp, G=2, **budget):
    """Every rank's selections of the model split as pp stages of tp ranks: {(layer, head): kept rows}."""
    world, stages = ThreadGroup(tp * pp), [ThreadGroup(tp) for _ in range(pp)]
    L, Hkv = len(model), model[0]["keys"].shape[0]
    kept, errors = {}, []

    def rank(r):
        try:
            s, t = r // tp, r % tp
            heads = [h for h in range(Hkv) if h * tp // Hkv == t]
            layers = list(range(L * s // pp, L * (s + 1) // pp))
            shard = dict(comm=world.comm(r), layer_group=stages[s].comm(t), layers=layers, kv_heads=heads)
            sels = kvevict.select_layers(policy, [part(model[l], heads, G) for l in layers], shard=shard, **budget)
            for l, sel in zip(layers, sels):
                for i, h in enumerate(heads):
                    kept[(l, h)] = sel.head(i).tolist()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp * pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return kept


@pytest.mark.parametrize("policy", ["layer-defensivekv", "open-defensivekv", "snapkv", "adakv", "defensivekv",
                                    "pyramidkv", "tova", "expected-attention"])
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1), (2, 2)])
def test_sharded_equals_one_rank(policy, tp, pp):
    model = random_model(np.random.default_rng(7))
    whole = kvevict.select_layers(policy, model, keep=0.3)
    kept = run_split(model, policy, tp, pp, keep=0.3)
    assert len(kept) == len(model) * 2
    for (l, h), rows in kept.items():
        assert rows == whole[l].head(h).tolist(), (policy, tp, pp, l, h)


def test_sharded_refusals():
    model = random_model(np.random.default_rng(3))
    with pytest.raises(ValueError, match="sharded selection runs without reference_quirks"):
        run_split(model, "snapkv", 2, 1, keep=0.3, reference_quirks=True)
    with pytest.raises(ValueError, match="shard needs comm"):
        kvevict.select_layers("snapkv", model, keep=0.3, shard=dict(layers=[0, 1, 2]))
    with pytest.raises(ValueError, match="one per layer passed"):
        kvevict.select_layers("snapkv", model, keep=0.3,
                              shard=dict(comm=ThreadGroup(1).comm(0), layers=[0], kv_heads=[0, 1]))

    class Broken:
        rank, size = 0, 1

        def all_gather(self, data):
            raise OSError("the network is down")

    with pytest.raises(RuntimeError, match="all_gather failed.*the network is down"):
        kvevict.select_layers("snapkv", model, keep=0.3, shard=dict(comm=Broken(), layers=[0, 1, 2], kv_heads=[0, 1]))
