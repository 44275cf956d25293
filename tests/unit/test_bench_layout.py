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


def test_chat_sends_the_built_in_chat_prompts_to_eos_or_the_output_length():
    """The offline chat workload's prompts (same seed, same order), served: issue 36's stack
    against transformers ``generate`` on one workload."""
    from loadtest import datasets
    from loadtest.chat_prompts import CHAT_PROMPTS

    opts, args = served("--dataset", "chat", "--output-len", "512", "--num-prompts", "256")
    argv = serve_argv(args, "h:1", 256, Path("/x"), "n")
    assert argv[argv.index("--dataset") + 1] == "chat"
    assert argv[argv.index("--num-prompts") + 1] == "256"
    assert opts.chat_max_tokens == 512

    from loadtest.workloads import chat_workload

    class Tok:  # the chat template: the user's text as is; a prompt's one token: its index
        vocab_size = len(CHAT_PROMPTS)

        def encode(self, text):
            return [CHAT_PROMPTS.index(text)]

        def apply_chat_template(self, messages):
            return messages[0]["content"]

    reqs = datasets.build_dataset("chat", 5, Tok(), opts)
    assert all(r.kind == "chat" and not r.ignore_eos and r.output_len == 512 for r in reqs)
    offline = chat_workload(5, Tok(), seed=0, max_output=512).requests
    assert [Tok().encode(r.prompt) for r in reqs] == [list(r.prompt_token_ids) for r in offline]
