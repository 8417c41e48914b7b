"""Model configs the theory knows by name: the engine's presets plus Llama-like ones.

``MODELS`` adds configs shaped like Llama 3 8B and 70B (Dubey et al. 2024, arXiv
2407.21783, Table 3: layers, width, heads, vocabulary 128256, context 8192).
``GPTConfig`` has no grouped-query attention and no SwiGLU, so the MLP width is chosen
to give the same parameters per layer (attention 4h^2 here instead of 2.5h^2 with 8 KV
heads; MLP 2hf instead of 3h * 14336 or 3h * 28672): 8.07B and 70.63B parameters,
against the real models' 8.03B and 70.55B (our biases and the head add the difference).
Their activation memory is only approximate (SwiGLU keeps more; grouped-query attention
keeps less). No field of ``GPTConfig`` needed to change for them.
"""

from __future__ import annotations

from minipar.model import PRESETS, GPTConfig, get_config

MODELS: dict[str, GPTConfig] = {
    **PRESETS,
    "llama3-8b-like": GPTConfig(vocab_size=128256, seq_len=8192, n_layer=32, n_head=32,
                                d_model=4096, d_ff=18432),
    "llama3-70b-like": GPTConfig(vocab_size=128256, seq_len=8192, n_layer=80, n_head=64,
                                 d_model=8192, d_ff=35840),
}


def get_model(name_or_config: str | GPTConfig) -> GPTConfig:
    """A config by name from ``MODELS`` (the engine's presets plus the Llama-like ones),
    or the config itself."""
    if isinstance(name_or_config, GPTConfig):  # (the common case: a planner's every call)
        return name_or_config
    if name_or_config in MODELS:
        return MODELS[name_or_config]
    return get_config(name_or_config)
