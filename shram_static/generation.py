"""transformers `generate()` on the static SHRAM state: the model-side hooks of `GenerationMixin`.

`ShramForCausalLM` inherits `ShramGenerationMixin`, which overrides the few hooks (transformers
5.x) that assume growing key/value caches: it builds or checks a `ShramCache` and the capacity
before anything runs, hands the forward only the new tokens' mask columns, and rejects
unsupported generation modes up front.
"""

import sys

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation import CompileConfig
from transformers.generation.streamers import BaseStreamer
from transformers.generation.configuration_utils import GenerationMode

from . import accelerators
from .cache import DEFAULT_PREFILL_CHUNK, ShramCache
from .rows import canonical
from .validation import check_capacity


def default_compile_config() -> CompileConfig:
    """`generate()`'s compile settings for the decode forward: one static graph, no breaks (on CPU
    set `compile_config._compile_all_devices = True`: transformers auto-compiles on accelerators)."""
    # mode "default": transformers' default "reduce-overhead" means CUDA graphs
    return CompileConfig(fullgraph=True, dynamic=False, mode="default")


def _new_token_mask(attention_mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """(B, n) bool live flags of the n new columns, canonical strides (the compiled forward guards
    on them); all True without a mask, so calls with and without one share a graph."""
    if attention_mask is None:
        return torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    return canonical(attention_mask[:, -ids.shape[1]:].to(torch.bool))


class ShramGenerationMixin(GenerationMixin):
    """`GenerationMixin` for SHRAM: greedy, sampling and beam search on a `ShramCache`."""

    # assisted / prompt-lookup decoding roll the cache back with `ShramCache.crop`
    _supported_generation_modes = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE,
                                   GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE,
                                   GenerationMode.ASSISTED_GENERATION)

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        if generation_mode not in self._supported_generation_modes:
            raise ValueError(f"{type(self).__name__}.generate does not support generation mode "
                             f"{generation_mode.value!r}; supported: "
                             f"{[m.value for m in self._supported_generation_modes]}")
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        cc = generation_config.compile_config
        if cc is not None and not cc._compile_all_devices and self.device.type == "cpu":
            # Our default compile_config is always set, so transformers would warn on every CPU
            # run that "you have set compile_config" but it cannot compile; skip quietly instead.
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def get_compiled_call(self, compile_config):
        """transformers' `torch.compile` of the forward, after `accelerators.prepare_compile` (a
        faster cold compile, as `StaticDecoder(compile=True)`: docs/performance.md, "Warm-up and export").

        Args:
            compile_config: `CompileConfig` or None (transformers' default handling).

        Returns:
            A callable with the forward's signature; the compiled function is `self._compiled_call`.
        """
        compiled = PreTrainedModel.get_compiled_call(self, compile_config)
        if compiled != self.__call__:  # else transformers declined to compile
            accelerators.prepare_compile(self.device.type)
        return compiled

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None,
                                      attention_mask=None, **kwargs):
        # The parent slices input_ids to the new tokens; it gets no mask, so it builds no 4-D one.
        inputs = super().prepare_inputs_for_generation(input_ids, next_sequence_length=next_sequence_length,
                                                       cache=cache, attention_mask=None, **kwargs)
        if cache is not None:
            inputs["attention_mask"] = _new_token_mask(attention_mask, inputs["input_ids"])
        elif attention_mask is not None:  # uncached: the whole sequence and its whole mask
            inputs["attention_mask"] = attention_mask
        return inputs

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode,
                                      batch_size, max_cache_length):
        """Builds or checks the `ShramCache`, then checks capacity, before any forward runs."""
        if generation_config.cache_implementation is not None:
            raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not "
                             f"supported: SHRAM generates on its own fixed-shape ShramCache (leave "
                             f"cache_implementation unset, or pass cache=ShramCache(...))")
        rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        cache = model_kwargs.get("cache")
        if cache is not None:
            if not isinstance(cache, ShramCache):
                raise ValueError(f"cache must be a shram_static.ShramCache, got {type(cache).__name__}")
            if cache.batch_size != rows:
                raise ValueError(f"the cache was built for batch_size={cache.batch_size}, but this call "
                                 f"runs {rows} rows (batch {batch_size} x beams / return sequences)")
            if cache.dtype != self.dtype or cache.device != self.device:
                raise ValueError(f"the cache holds {cache.dtype} on {cache.device}, the model runs "
                                 f"{self.dtype} on {self.device}; build the cache with the model's")
        mask = model_kwargs.get("attention_mask")
        n_in = mask.shape[1] if mask is not None else generation_config._mask_length
        past = cache.get_seq_length() if cache is not None else 0
        if past >= n_in:
            raise ValueError(f"the cache already consumed {past} columns but input_ids has {n_in}: when "
                             f"continuing a cache, pass the whole sequence so far plus at least one new token")
        # The last new token is returned, not fed back: max_new_tokens - 1 more live tokens.
        fed_after = max(generation_config.max_length - n_in - 1, 0)
        new_live = (mask[:, past:].long().sum(1).cpu() if mask is not None
                    else torch.full((rows,), n_in - past, dtype=torch.long))
        held = cache.live_counts.cpu() if cache is not None else torch.zeros(rows, dtype=torch.long)
        need = held + new_live + fed_after
        check_capacity(need, self.config.inference_sequence_length,
                       f" ({int(held.max())} cached + {int(new_live.max())} new input + {fed_after} "
                       f"generated and fed back)",
                       "lower max_new_tokens, shorten the input, or load the model with a larger "
                       "inference_sequence_length")
        if cache is not None:
            cache._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return  # the uncached forward over the whole sequence at every step
        chunk = generation_config.prefill_chunk_size or DEFAULT_PREFILL_CHUNK
        drafts = 0  # assisted decoding forgets up to its draft length per step (`crop`)
        if generation_mode == GenerationMode.ASSISTED_GENERATION:
            drafts = max(generation_config.prompt_lookup_num_tokens or 0, generation_config.num_assistant_tokens or 0)
        model_kwargs["cache"] = ShramCache(self.config, rows, chunk, dtype=self.dtype, device=self.device,
                                           rollback_limit=drafts)


class TextTokenStreamer(BaseStreamer):
    """Writes a single sequence's new text to a stream as tokens are produced.

    A transformers streamer: the first `put` is the prompt (skipped); `end()` writes the rest and
    a newline. A UTF-8 character split over byte tokens is held back until complete; tokens from
    the first `eos_token_id` on are dropped.

    Args:
        tokenizer: has `decode(list[int]) -> str`.
        stream: text stream to write to (default sys.stdout).
        eos_token_id: id that ends the text (None: never).
    """

    def __init__(self, tokenizer, stream=None, eos_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.stream = stream if stream is not None else sys.stdout
        self.eos_token_id = eos_token_id
        self.tokens: list[int] = []
        self.written = ""
        self._prompt_seen = False
        self._stopped = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        value = torch.as_tensor(value)
        if value.dim() == 2:
            if value.shape[0] != 1:
                raise ValueError(f"TextTokenStreamer streams one sequence, got a batch of {value.shape[0]}")
            value = value[0]
        elif value.dim() == 1 and value.numel() != 1:
            raise ValueError(f"TextTokenStreamer streams one sequence, got {value.numel()} tokens at once "
                             f"in a 1-D tensor (a batch?)")
        for i in value.reshape(-1).tolist():
            if self._stopped or i == self.eos_token_id:
                self._stopped = True
                break
            self.tokens.append(int(i))
        text = self.text
        if not text.endswith("\ufffd"):  # else: an incomplete character, wait for its next bytes
            self._write(text)

    def end(self) -> None:
        self._write(self.text)
        self.stream.write("\n")
        self.stream.flush()

    @property
    def text(self) -> str:
        """The whole text so far (what `end()` completes the output to)."""
        return self.tokenizer.decode(self.tokens)

    def _write(self, text: str) -> None:
        if text.startswith(self.written) and len(text) > len(self.written):
            self.stream.write(text[len(self.written):])
            self.stream.flush()
            self.written = text
