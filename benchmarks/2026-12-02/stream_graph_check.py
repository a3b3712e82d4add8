import time, torch
from cosytrt.tools.bench import full_models, _pipeline_with_random_frontend
from cosytrt.runtime.models.loading import CosyVoice3Models
from cosytrt.runtime.stages.pipeline import Pipeline
from cosytrt.runtime.stages.engine_set import attach_cuda_graphs
from cosytrt.runtime.stages.profile import load_profile
from cosytrt.runtime.stages.request import Request
from cosytrt.runtime.models.sampling import SamplingParams
from cosytrt.tools.golden import snr_db
cfg, llm, flow, hift = full_models("cuda", torch.bfloat16)
m = CosyVoice3Models(cfg, llm, flow, hift, "random-full", "", "random")
eager = _pipeline_with_random_frontend(m, Pipeline)
req = lambda: Request(text="a" * 40, stream=True, sampling=SamplingParams(seed=0, force_tokens=250))
a, _ = eager.synthesize(req())
g = _pipeline_with_random_frontend(m, Pipeline)
t = time.time(); es = attach_cuda_graphs(g, load_profile("h200-graphs")); print("capture s", round(time.time() - t, 1))
b, mt = g.synthesize(req())
b, mt = g.synthesize(req())
print("samples", a.shape, b.shape, "SNR dB graphs vs eager", snr_db(torch.from_numpy(a), torch.from_numpy(b)))
s = es.stats.summary()["stages"]
print({k: (v["hits"], v["fallbacks"], v["fallback_reasons"]) for k, v in s.items()})
print("pipeline c1 stream TTFA", round(mt.ttfa, 3), "T_vocoder", round(mt.t_vocoder, 3), "RTF", round(mt.rtf, 3))
