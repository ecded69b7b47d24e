"""The registry of KV setups, LMCache's tiers in it, and `kvlab setup`."""
