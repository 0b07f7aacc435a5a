"""Engine-agnostic KV-cache logic the engine plugins share: block layouts, prefix keys, hand-offs."""
