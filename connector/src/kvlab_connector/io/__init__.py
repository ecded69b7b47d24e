"""I/O engines the store reads and writes with: POSIX (O_DIRECT) and GDS (kvikio)."""
