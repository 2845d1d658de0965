# install + export + kvevictConfig.cmake so consumers can find_package(kvevict CONFIG).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS kvevict EXPORT kvevictTargets)
install(DIRECTORY include/kvevict DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT kvevictTargets NAMESPACE kvevict:: DESTINATION ${CMAKE_INSTALL_DATADIR}/cmake/kvevict)
# The C API's libraries (KVEVICT_BUILD_C), in an export set of their own: kvevictConfig.cmake loads it when present
# (find_package(kvevict CONFIG COMPONENTS c)), and the header-only package stays what it was without them.
if(TARGET kvevict_c)
  install(TARGETS kvevict_c kvevict_c_shared EXPORT kvevictCTargets)
  install(EXPORT kvevictCTargets NAMESPACE kvevict:: DESTINATION ${CMAKE_INSTALL_DATADIR}/cmake/kvevict)
endif()

configure_package_config_file(cmake/kvevictConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/kvevictConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_DATADIR}/cmake/kvevict)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/kvevictConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kvevictConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/kvevictConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_DATADIR}/cmake/kvevict)
