"""Full cache: the uncompressed reference every method is compared with."""

from dataclasses import dataclass

from kvbench.methods.base import Method, register_method


@register_method
@dataclass
class Full(Method):
    """The whole cache, attended by the one decode attention, GQA-aware: each KV head is read once per step.

    `repeat_kv=true` is the dense baseline of RocketKV's efficiency figure (its released gpt-fast code):
    every decode step repeats K and V to every query head (`repeat_interleave` of the whole cache, as gpt-fast
    does) and attends over the copies, so it reads G times the K/V of the GQA-aware cache (G = query heads per
    KV head, 4 on Llama-3.1-8B); its traffic counts those reads (not the copy's own write). Same outputs,
    another cost: how much of a speedup over "full" the baseline explains. null means false.
    Its attention is the release's: masked math attention over the whole cache (NVlabs/RocketKV 63637c8,
    `gpt-fast/model.py` `DenseAttentionFunction`, run by `gpt-fast/generate.py` `decode_n_tokens` with SDPA's
    flash and memory-efficient kernels off), so the compiled loop holds the prompt plus its tokens in 256-row
    steps, as close as that to the release's `max_seq_length` (`StaticKVLayer.enter`'s `tight`; docs/fidelity.md).
    """

    name = "full"
    uses_budget = False
    repeat_kv: bool | None = None

    @property
    def repeats_kv(self) -> bool:
        return bool(self.repeat_kv)
