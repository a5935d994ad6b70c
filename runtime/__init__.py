"""torch.distributed executor of a `Plan`.

Will hold (issue: runtime): `CPHPAttention` (uneven all-to-all into head-sharded form, uneven
ring attention with log-sum-exp merging, explicit ring backward), a Llama-style model and the
torchrun train loop that records measured step time and memory into the store (DESIGN.md §8).
This package may import the core and torch only, never search, costmodel or dashboard.
"""
