"""minivllm: a small, readable LLM inference engine that teaches how vLLM-class engines work.

    from minivllm import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

import gc

# The imports below (torch and transformers among them) create ~200k objects that live as long as the process;
# with the collector on, they set off full collections that walk them all (~0.3 s of CPU on a Zen 4). Paused
# here, they are walked once, by the engine's collection at the end of its start (engine/llm_engine.py).
_collecting = gc.isenabled()
gc.disable()
try:
    from minivllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.metrics.stats import EngineStats
    from minivllm.llm import LLM
    from minivllm.outputs import CompletionOutput, RequestOutput
    from minivllm.sampling_params import RequestOutputKind, SamplingParams
    from minivllm.structured_outputs import StructuredOutputsParams
finally:
    if _collecting:
        gc.enable()
    del _collecting

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "EngineConfig", "EngineStats", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "StructuredOutputsParams"]
__version__ = "0.1.0"
