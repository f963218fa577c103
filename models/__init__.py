"""Model-side math for a2d: pure functions over arrays and tensors, no orchestration or I/O."""
