"""The generation steps: VACE conditioning, the dual-expert sampling loop, decoding."""
