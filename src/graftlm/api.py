"""The public Python API: `graftlm.load()` and `Model`."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graftlm.config import ModelConfig
from graftlm.errors import GraftError, ModelFileError
from graftlm.gguf import GGUFFile
from graftlm.lora.adapter_set import AdapterSet
from graftlm.lora.settings import AdapterSettings
from graftlm.models import Transformer, build_model, context_size
from graftlm.native import release_threads
from graftlm.native.heap import hold_freed_memory, use_huge_pages
from graftlm.quant.native_tables import iq_in_place
from graftlm.resources import default_model_path
from graftlm.runtime.constraints import Constraint
from graftlm.runtime.device import resolve_device
from graftlm.runtime.draft_model import check_vocabulary
from graftlm.runtime.engine import Engine
from graftlm.runtime.prompting import Prompter
from graftlm.runtime.reasoning import (
    REASONING_FORMATS,
    AnswerParser,
    ChatReply,
    answer_syntax,
    split_pieces,
    thinking_forced_open,
)
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.runtime.scoring import Scorer
from graftlm.runtime.speculative import SpecConfig
from graftlm.step.kv_cache import BLOCK, DEFAULT_KV_TYPE, block_nbytes, kv_dtype
from graftlm.tokenizer import Tokenizer
from graftlm.tokenizer.chat import ChatTemplateError, TemplateLimitError, render_chat
from graftlm.tokenizer.templates import family_template, resolve_chat_template


@dataclass
class Timings:
    n_prompt: int = 0
    n_generated: int = 0
    prompt_s: float = 0.0
    generate_s: float = 0.0
    n_cached: int = 0  # prompt tokens the prefix cache served (not computed)

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens computed a second (those the cache served not counted)."""
        n = self.n_prompt - self.n_cached
        return n / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def generate_tps(self) -> float:
        # the first token comes from the prompt's logits; decode steps made the rest
        steps = self.n_generated - 1
        return steps / self.generate_s if self.generate_s > 0 and steps > 0 else 0.0


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    threads: int | None = None,
    ctx_size: int = 4096,
    n_seq: int = 1,
    reference: bool = False,
    progress: bool = False,
    device: str | torch.device = "cpu",
    chat_template: str | None = None,
    chat_template_file: str | os.PathLike[str] | None = None,
    cache_type: str | None = None,
    cache_blocks: int | None = None,
    cache_bytes: int | None = None,
    prefix_cache: bool = True,
    speculative: SpecConfig | str | None = None,
    draft_model: str | os.PathLike[str] | None = None,
) -> Model:
    """Load a GGUF model (None: the embedded SmolLM2-135M-Instruct Q4_1).

    The KV cache is paged: `cache_type` is its values' type as llama.cpp names it ("f16", the
    default, "bf16" or "f32"; the reference oracle's default is "f32"); `cache_blocks` its pool in blocks of 16 positions (default: every
    sequence's whole context), or `cache_bytes` its size in bytes; `prefix_cache` reuses what earlier requests (earlier turns of a
    chat) computed for the same tokens under the same adapter settings.

    `reference=True` dequantizes every weight to float32: the slow oracle, not the product.
    `device`: "cpu" (compact quantized weights, native kernels), or "cuda" / "cuda:N": every
    weight becomes a dense bfloat16 copy on the GPU and the step runs in plain PyTorch (close to,
    not bit-exact with, the CPU path). GraftError when the device is not there.
    `chat_template`: a built-in template's name (chatml, llama3, gemma, phi3, mistral) or Jinja
    text, or `chat_template_file` a file of it, in place of the file's own template.
    `speculative`: "ngram" (or a `SpecConfig`) drafts tokens from each request's own prompt and
    output and verifies them in the step: the same output, faster where the text repeats.
    `draft_model`: a small GGUF of the same vocabulary that drafts instead (method "draft", the
    default once it is given).
    """
    template = resolve_chat_template(chat_template, chat_template_file)
    if isinstance(speculative, str):
        speculative = SpecConfig(method=speculative)
    if isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq < 1:
        raise GraftError(f"n_seq must be a whole number of sequences, at least 1; got {n_seq!r}")
    dev = _prepare_device(device, reference, threads)
    file = GGUFFile(default_model_path() if path is None else path)
    n_ctx = context_size(file, ctx_size)
    prefer = "reference" if reference else "fast"
    model = _build_on(dev, file, n_ctx, prefer, progress)
    tokenizer = Tokenizer.from_file(file)
    kv_type = cache_type or ("f32" if reference else DEFAULT_KV_TYPE)
    if cache_bytes is not None:
        cache_blocks = _blocks_in(cache_bytes, model.cfg, kv_type)
    draft = None
    if draft_model is not None:
        draft = _load_draft(draft_model, file, n_ctx, prefer, dev)
        if speculative is None:
            speculative = SpecConfig(method="draft")
    loaded = Model(
        file,
        model,
        tokenizer,
        n_seq=n_seq,
        kv_dtype=kv_dtype(kv_type),
        cache_blocks=cache_blocks,
        prefix_cache=prefix_cache,
        chat_template=template,
        speculative=speculative,
        draft_model=draft,
    )
    if dev.type == "cpu":  # last (the engine's cache is made in parallel regions too): whichever
        release_threads()  # thread steps next makes its own pool (release_threads)
    return loaded


def _prepare_device(
    device: str | torch.device, reference: bool, threads: int | None
) -> torch.device:
    """The device checked (the reference oracle runs on the CPU alone), torch's threads set, and
    on the CPU the heap readied before the weights are packed (native.heap)."""
    dev = resolve_device(device)
    if reference and dev.type != "cpu":
        raise GraftError(
            f"reference=True is the float32 CPU oracle; it does not run on device {str(device)!r}"
        )
    if threads is not None and threads > 0:
        torch.set_num_threads(threads)
    if dev.type == "cpu":
        hold_freed_memory()  # a step's activations stay in the heap for the next
        use_huge_pages()  # the weights in transparent huge pages
    return dev


def _blocks_in(cache_bytes: int, cfg: ModelConfig, kv_type: str) -> int:
    """The KV cache pool's blocks that `cache_bytes` holds, block 0 (which holds nothing) added."""
    per = block_nbytes(cfg, kv_dtype(kv_type))
    if cache_bytes < per:
        raise GraftError(
            f"a KV cache of {cache_bytes} bytes holds no block: one block of {BLOCK} "
            f"positions takes {per} bytes ({kv_type})"
        )
    return cache_bytes // per + 1


def _load_draft(
    path: str | os.PathLike[str], file: GGUFFile, n_ctx: int, prefer: str, dev: torch.device
) -> Transformer:
    """The draft model of speculative decoding, its vocabulary checked against the target's."""
    draft_file = GGUFFile(path)
    check_vocabulary(
        list(file.get("tokenizer.ggml.tokens") or []),
        list(draft_file.get("tokenizer.ggml.tokens") or []),
        str(path),
    )
    return _build_on(dev, draft_file, n_ctx, prefer)


def _build_on(
    dev: torch.device, file: GGUFFile, n_ctx: int, prefer: str, progress: bool = False
) -> Transformer:
    """The model of a file on dev: built on the CPU, then moved; bound for another device, its
    grid-quant weights stay the file's bytes (iq_in_place: no tiles packed only to be dropped)."""
    if dev.type == "cpu":
        return build_model(file, n_ctx, prefer=prefer, progress=progress)
    with iq_in_place():
        model = build_model(file, n_ctx, prefer=prefer, progress=progress)
    model.to(dev)
    return model


class Model:
    """A loaded base model, its tokenizer and its engine (and, later, its adapters)."""

    def __init__(
        self,
        file: GGUFFile,
        model: Transformer,
        tokenizer: Tokenizer,
        n_seq: int = 1,
        kv_dtype: torch.dtype | None = None,
        cache_blocks: int | None = None,
        prefix_cache: bool = True,
        chat_template: str | None = None,
        speculative: SpecConfig | None = None,
        draft_model: Transformer | None = None,
    ) -> None:
        self.file = file
        self.path = Path(file.path)
        self.model = model
        self.tokenizer = tokenizer
        self.engine = Engine(
            model,
            n_slots=n_seq,
            n_blocks=cache_blocks,
            kv_dtype=kv_dtype,
            prefix_cache=prefix_cache,
            speculative=speculative,
            draft_model=draft_model,
        )
        template = chat_template or file.get("tokenizer.chat_template") or family_template(file)
        check_template_limits(template, file.path)
        self.prompter = Prompter(tokenizer, template, model.cfg.n_vocab)
        self.scorer = Scorer(self.engine, self.prompter)
        self.last_timings = Timings()
        self.adapters = AdapterSet(model)
        self.engine.invocations = self.adapters.invocations  # activated LoRA's starts

    # -- facts -----------------------------------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def resident_bytes(self) -> int:
        """Bytes held for weights and the KV cache."""
        assert self.model.cache is not None
        return self.model.nbytes + self.model.cache.nbytes

    @property
    def chat_template(self) -> str | None:
        return self.prompter.chat_template

    # -- text ------------------------------------------------------------------------------------
    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        return self.prompter.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.prompter.detokenize(ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return self.prompter.apply_chat_template(messages, add_generation_prompt)

    # -- adapters -------------------------------------------------------------------------------
    def add_lora(self, path: str | os.PathLike[str], scale: float = 1.0) -> int:
        """Attach a LoRA adapter (llama.cpp GGUF file or PEFT directory); returns its id.

        Everything is checked first: a refused adapter raises AdapterError and changes nothing."""
        with self.engine.lock:
            adapter = self.adapters.load(Path(path))
            return self.adapters.attach(adapter, self.adapters.check_attach(adapter, scale))

    def remove_lora(self, adapter_id: int) -> None:
        with self.engine.lock:
            self.adapters.detach(adapter_id)

    @property
    def loras(self) -> list[dict[str, Any]]:
        """id, path, scale, alpha, task_name, prompt_prefix, n_tensors, bytes of each adapter."""
        return self.adapters.info()

    def set_lora_scales(self, scales: dict[int, float]) -> None:
        """Set the model's adapter scales; adapters not listed go to 0 (llama-server semantics).
        Checked (ids, values, float16 range alone and together) whatever mapping they come in:
        AdapterError, and nothing changes."""
        with self.engine.lock:  # (a plain dict: set_scales takes AdapterSettings as checked)
            self.adapters.set_scales(dict(scales.items()))

    # -- scoring and generation ------------------------------------------------------------------
    def logits(self, ids: Sequence[int], lora: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """Raw logits (len(ids), n_vocab) after each prefix of ids, in one teacher-forced pass.
        `lora`: [{"id", "scale"}] for this call only (unlisted adapters at 0); None: the model's
        own scales."""
        return self.scorer.logits(ids, self.adapters.call_settings(lora))

    def logprobs(
        self, ids: Sequence[int], top: int = 5, lora: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """For i in 1..len(ids)-1: the log-probability of ids[i] after ids[:i], and the `top` most
        likely tokens (at most the whole vocabulary)."""
        return self.scorer.logprobs(ids, top, self.adapters.call_settings(lora))

    def embed(
        self, text: str | Sequence[int], lora: list[dict[str, Any]] | None = None
    ) -> list[float]:
        """The text's embedding: the mean of the final-norm hidden states over its tokens,
        L2-normalized (n_embd floats); `lora` as for `logits`."""
        ids = self.prompter.prompt_ids(text)
        return self.scorer.embedding(ids, self.adapters.call_settings(lora))

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        ignore_eos: bool = False,
        lora: list[dict[str, Any]] | None = None,
        stream: bool = False,
        logit_bias: dict[int | str, float | bool] | list[Any] | None = None,
        json_schema: dict[str, Any] | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
    ) -> str | Iterator[str]:
        """Continue a prompt (text or token ids). Returns the text, or with stream=True an iterator
        of text pieces as they are generated.

        `logit_bias`: {token id: bias in [-100, 100]} (-100 or False bans, 100 forces; a text key
        biases each of its tokens), or llama-server's [[token, bias]]. At most one constraint:
        `json_schema` (a JSON schema as a dict), `regex`, `choice` (one of these strings) or
        `grammar` (GBNF, as llama.cpp's grammars): every token generated follows it, and the end
        comes only where it is complete. ConstraintError when it does not compile."""
        constraint = _constraint(json_schema, regex, choice, grammar)
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            seed=seed,
            max_tokens=max_tokens,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            ignore_eos=ignore_eos,
            logit_bias=self.prompter.logit_bias(logit_bias),
            grammar=None if constraint is None else self.prompter.compile(constraint),
        )
        ids = self.prompter.prompt_ids(prompt)
        pieces = self._run(ids, params, self.adapters.call_settings(lora))
        return pieces if stream else "".join(pieces)

    def chat(
        self, messages: list[dict[str, Any]], reasoning_format: str = "auto", **kwargs: Any
    ) -> ChatReply | Iterator[ChatReply]:
        """`generate` on the messages rendered through the model's chat template, its answer
        split as llama-server and llama-cli split it: a `ChatReply`, the content, with the
        reasoning apart in `.reasoning` (or with stream=True an iterator of them, piece by piece).

        `reasoning_format` (llama-server's --reasoning-format): "auto" and "deepseek" keep the
        reasoning apart; "deepseek-legacy" keeps it in the content too, between `<think>` tags
        (streamed: only there); "none" parses nothing: a `<think>` answer is content as written,
        and a harmony answer's analysis stays in the content with its own tags (llama-server's
        output)."""
        if reasoning_format not in REASONING_FORMATS:
            raise GraftError(
                f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}; "
                f"got {reasoning_format!r}"
            )
        syntax = answer_syntax(self.chat_template)
        text = self.apply_chat_template(messages)
        # (R1's templates open the <think> block in the prompt: the answer starts inside it)
        forced_open = syntax == "think" and thinking_forced_open(text)
        stream = bool(kwargs.pop("stream", False))
        parser = AnswerParser(syntax, reasoning_format, None, forced_open, stream=stream)
        pieces = self.generate(self.prompter.chat_ids(text), stream=True, **kwargs)
        assert not isinstance(pieces, str)
        replies = split_pieces(pieces, parser)
        if stream:
            return replies
        parts = list(replies)
        return ChatReply("".join(parts), "".join(p.reasoning for p in parts))

    def _run(self, ids: list[int], params: SamplingParams, lora: AdapterSettings) -> Iterator[str]:
        text = self.prompter.text_stream(params.stop, params.ignore_eos)
        req = Request(ids, params, lora, eog=self.prompter.eog)
        if params.max_tokens == 0:
            return
        self.engine.submit(req)
        seen = 0
        t0 = time.perf_counter()
        try:
            while not req.done:
                self.engine.step()
                while seen < len(req.generated):
                    piece = text.push(req.generated[seen])
                    seen += 1
                    if text.stopped:
                        self.engine.stop(req)
                    if piece:
                        yield piece
            if req.error is not None:
                raise req.error
            tail = text.flush()
            if tail:
                yield tail
        finally:
            if not req.done:
                self.engine.stop(req, "cancelled")
            t_prompt = (req.t_prompt_done or time.perf_counter()) - t0
            t_end = req.t_end or time.perf_counter()
            self.last_timings = Timings(
                len(ids),
                len(req.generated),
                t_prompt,
                t_end - (req.t_prompt_done or t_end),
                req.n_cached,
            )


def check_template_limits(template: str | None, path: str | os.PathLike[str]) -> None:
    """A model's chat template is untrusted: rendered once at load on a short conversation,
    one that runs past the renderer's limits (time, size) refuses the model. A template that
    merely rejects this conversation (raise_exception) is left to the requests."""
    if template is None:
        return
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}]  # fmt: skip
    try:
        render_chat(template, chat)
    except TemplateLimitError as exc:
        raise ModelFileError(
            f"{path}: the chat template is refused ({exc}); give another with "
            "--chat-template NAME or --chat-template-file FILE"
        ) from None
    except ChatTemplateError:
        pass


def _constraint(
    json_schema: dict[str, Any] | None,
    regex: str | None,
    choice: Sequence[str] | None,
    grammar: str | None,
) -> Constraint | None:
    given = {
        k: v
        for k, v in (
            ("json_schema", json_schema),
            ("regex", regex),
            ("choice", choice),
            ("grammar", grammar),
        )
        if v is not None
    }
    if len(given) > 1:
        raise GraftError(f"give at most one constraint; got {', '.join(given)}")
    if json_schema is not None:
        return Constraint.json_schema(json_schema)
    if regex is not None:
        return Constraint("regex", regex, "regex")
    if choice is not None:
        return Constraint.choice(list(choice))
    if grammar is not None:
        return Constraint("gbnf", grammar, "grammar")
    return None
