"""Engine adapters: one per backend behind one small interface."""
