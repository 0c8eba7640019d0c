"""`graftlm run`: generate from a prompt, or chat, as llama-cli does."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from graftlm.errors import GraftError


def _print_adapters(model: Any) -> None:
    for a in model.loras:
        print(
            f"lora {a['id']}: {a['path']} ({a['n_tensors']} tensors, alpha {a['alpha']:g}, scale {a['scale']:g})",
            file=sys.stderr,
        )


def _timings(model: Any) -> None:
    t = model.last_timings
    print(
        f"\n\nprompt: {t.n_prompt} tokens"
        + (f" ({t.n_cached} from the prefix cache)" if t.n_cached else "")
        + f", {t.prompt_s * 1000:.1f} ms, {t.prompt_tps:.1f} tok/s | "
        f"generation: {t.n_generated} tokens, {t.generate_s * 1000:.1f} ms, {t.generate_tps:.1f} tok/s | "
        f"resident {model.resident_bytes / 2**20:.0f} MiB",
        file=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    import graftlm
    from graftlm.commands import check_adapters_first, warn_if_slow
    from graftlm.commands.llama_flags import cache_type, check_llama_flags
    from graftlm.commands.lora_args import lora_specs
    from graftlm.commands.spec_args import spec_config

    check_llama_flags(args)
    speculative = spec_config(args)

    specs = lora_specs(args.lora, args.lora_scaled, args.lora_init_without_apply)
    prompt = args.prompt
    if args.file is not None:
        try:
            prompt = Path(args.file).read_text(encoding="utf-8")
        except OSError as exc:
            raise GraftError(f"{args.file}: cannot read the prompt file ({exc.strerror})") from None
    if prompt is None and not args.conversation:
        raise GraftError("give a prompt with -p or -f, or chat with -cnv")

    check_adapters_first(args.model, [s.path for s in specs])
    t0 = time.perf_counter()
    model = graftlm.load(
        args.model,
        threads=args.threads,
        ctx_size=args.ctx_size,
        reference=args.reference,
        progress=True,
        device=args.device,
        chat_template=args.chat_template,
        chat_template_file=args.chat_template_file,
        cache_type=cache_type(args),
        speculative=speculative,
        draft_model=args.model_draft,
    )
    print(
        f"loaded {model.path.name}: {model.config.arch}, {model.config.n_layer} layers, "
        f"{model.resident_bytes / 2**20:.0f} MiB resident, {time.perf_counter() - t0:.2f} s",
        file=sys.stderr,
    )
    warn_if_slow(args.device)
    for spec in specs:
        i = model.add_lora(spec.path, spec.scale)
        for note in model.adapters.attached[i].adapter.notes:
            print(f"lora {i}: {note}", file=sys.stderr)
    _print_adapters(model)

    sampling = dict(
        max_tokens=args.n_predict,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=None if args.seed < 0 else args.seed,
        ignore_eos=args.ignore_eos,
    )
    if args.conversation:
        from graftlm.commands.chat import chat_loop

        code = chat_loop(
            model, sampling, args.system_prompt, prompt, reasoning_format=args.reasoning_format
        )
        _timings(model)
        return code
    for piece in model.generate(prompt, stream=True, **sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    _timings(model)
    return 0
