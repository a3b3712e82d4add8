"""Input and output names of the exported stage graphs: the contract between the exporters (build/) and the runners
that feed them (runtime/stages/)."""

DIT_INPUTS = ("x", "mask", "mu", "t", "spks", "cond")
DIT_OUTPUT = "estimator_out"
HIFT_INPUTS = ("mel", "sine_noise")
HIFT_OUTPUT = "wav"
SAMPLES_PER_MEL_FRAME = 480  # HiFT output samples per input mel frame (24 kHz audio, 50 Hz mel)
