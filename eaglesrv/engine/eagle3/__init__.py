"""EAGLE-3 speculative decoding: the draft head, draft trees, verification, the step runner."""
