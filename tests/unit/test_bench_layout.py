"""scripts/bench_layout.py's load: the flags it hands ``bench serve`` parse there into the
workload it says (the random prompts of issue 15, issue 37's long-prompt mix)."""
from __future__ import annotations

from pathlib import Path

from loadtest import serve
from scripts.bench_layout import build_parser, serve_argv


def served(*flags: str, concurrency: int = 16):
    args = build_parser().parse_args(list(flags))
    return serve.dataset_options(serve.build_parser().parse_args(
        serve_argv(args, "127.0.0.1:1", concurrency, Path("/tmp/x"), "n"))), args


def test_the_default_load_is_random_prompts_of_the_input_length():
    opts, _ = served("--input-len", "512", "--output-len", "128", "--output-range-ratio", "0")
    argv = serve_argv(build_parser().parse_args(["--input-len", "512"]), "h:1", 1, Path("/x"), "n")
    assert argv[argv.index("--dataset") + 1] == "random"
    assert (opts.input_len, opts.output_len, opts.range_ratio) == (512, 128, 0.0)
    assert argv[argv.index("--num-prompts") + 1] == "16"  # the single stream's count


def test_long_mix_sends_chats_with_some_8k_prompts_among_them():
    opts, args = served("--dataset", "long-mix", "--output-len", "64", "--long-fraction", "0.25")
    argv = serve_argv(args, "h:1", 16, Path("/x"), "n")
    assert argv[argv.index("--dataset") + 1] == "long-mix"
    assert opts.long_fraction == 0.25 and opts.long_input_range == (7936, 8064)
    assert opts.chat_max_tokens == 64 and opts.long_output_len == 64
