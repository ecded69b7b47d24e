"""kvlab's store as LMCache's L2 adapter (MP mode): the adapter, its configuration and keys."""
