"""Microbenchmarks on one device and on links, written to the store.

Will hold (issue: profiler and fitted cost model): GEMM, attention forward/backward and
elementwise sweeps per device type, p2p and all-to-all link sweeps under torchrun, each row
recorded with device identity, software versions and timing statistics (DESIGN.md §5).
"""
