"""`kvflow generate` (one prompt, streamed) and `kvflow chat` (multi-turn in the terminal)."""

from __future__ import annotations

import argparse
import sys
import time

from kvflow.cli.engine_args import add_engine_args, engine_config_from_args


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true", help="log engine start-up and print timings")


def register(subparsers: argparse._SubParsersAction) -> None:
    g = subparsers.add_parser(
        "generate",
        help="generate text for one prompt, streamed to the terminal",
        description="Generate a completion for PROMPT and stream it to stdout.",
    )
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling_args(g)
    add_engine_args(g)
    g.set_defaults(func=run_generate)

    c = subparsers.add_parser(
        "chat",
        help="interactive multi-turn chat in the terminal",
        description="Chat with the model; an empty line or Ctrl-D ends the chat.",
    )
    c.add_argument("--system", default=None, help="a system message for the conversation")
    _add_sampling_args(c)
    add_engine_args(c)
    c.set_defaults(func=run_chat)


def _sampling(args: argparse.Namespace):
    from kvflow.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )  # --seed (an engine option) seeds the sampling


def _stream(engine, prompt: str, params, add_special_tokens: bool) -> tuple[str, float | None, int]:
    """Run one request, printing text as it arrives; returns (text, first-token time, tokens)."""
    rid = engine.add_request(None, prompt, params, add_special_tokens=add_special_tokens)
    shown, first, n_tokens = "", None, 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                text = out.outputs[0].text
                if first is None and out.outputs[0].token_ids:
                    first = time.monotonic()
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown, n_tokens = text, len(out.outputs[0].token_ids)
    except KeyboardInterrupt:
        engine.abort(rid)
        raise
    sys.stdout.write("\n")
    return shown, first, n_tokens


def run_generate(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    from kvflow.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:
        prompt = _chat_prompt(engine, [{"role": "user", "content": prompt}])
    t_ready = time.monotonic()
    _, first, n = _stream(engine, prompt, _sampling(args), add_special_tokens=not args.chat)
    t_end = time.monotonic()
    if args.verbose and first is not None:
        decode = (n - 1) / (t_end - first) if n > 1 and t_end > first else float("nan")
        print(
            f"[kvflow] start-up {t_ready - _PROCESS_START:.2f} s (engine {t_ready - t0:.2f} s), "
            f"process start to first token {first - _PROCESS_START:.2f} s, {n} tokens, "
            f"{decode:.1f} tok/s decode",
            file=sys.stderr,
        )
    return 0


def _chat_prompt(engine, messages: list[dict[str, str]]) -> str:
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("this model has no chat template; drop --chat")
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def run_chat(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kvflow chat: type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply, _, _ = _stream(engine, _chat_prompt(engine, messages), _sampling(args), add_special_tokens=False)
        messages.append({"role": "assistant", "content": reply})
    return 0


_PROCESS_START = time.monotonic()
