"""eaglesrv: an OpenAI-compatible LLM server built around EAGLE-3 speculative decoding."""

from eaglesrv.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
