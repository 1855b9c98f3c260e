"""Per-model acceptance tables of the prompt-lookup tree (NgramTreeDrafter) and the script
that measures them (bench/fit_ngram_tables.py)."""
import json
from types import SimpleNamespace

import pytest

from bench.bench_e2e import load_prompts
import bench.fit_ngram_tables as fit
from bench.fit_ngram_tables import count_matches, held_out_prompts, openings_from, simulate, tables_from_counts
from specdec_kernels.decoding import Generator, SpecSchedule
from specdec_kernels.decoding.cost_model import StepCost
from specdec_kernels.models import Llama, tiny_config
from specdec_kernels.drafting.ngram import NGRAM_TABLES_PATH, NgramTables, NgramTreeDrafter, ngram_tables_for


def test_tables_are_found_by_model_name():
    entries = json.loads(NGRAM_TABLES_PATH.read_text())
    assert "qwen2.5-coder-1.5b" in entries
    entry = entries["qwen2.5-coder-1.5b"]
    tables = ngram_tables_for("Qwen2.5 Coder 1.5B Instruct GGUF")  # the loaded model's name
    openings = tuple((tuple(key), tuple(opening), n) for key, opening, n in entry["openings"])
    assert tables == NgramTables(tuple(entry["first"]), tuple(entry["next"]), tuple(entry["rank"]), openings)
    assert openings and "bench/fit_ngram_tables.py" in entry["openings_source"]
    assert ngram_tables_for("qwen2.5-coder-1.5b") == tables
    assert "bench/fit_ngram_tables.py" in entry["source"] and entry["counts"]["first"]  # measured, with its data
    assert ngram_tables_for("SmolLM2-135M-Instruct") is None  # no file entry: the class's own tables
    with pytest.raises(ValueError, match="no prompt-lookup tables were measured for 'nonesuch'"):
        NgramTreeDrafter(tables="nonesuch")


def test_drafter_takes_the_targets_tables_at_start():
    qwen = ngram_tables_for("qwen2.5-coder-1.5b")
    flat = StepCost({1: {1: 1.0, 64: 1.0}})

    def started(model_name, **kw):
        d = NgramTreeDrafter(step_cost=flat, **kw)
        gen = SimpleNamespace(model=SimpleNamespace(name=model_name), drafter_step_cost=lambda own, step_seconds=None: own)
        d.start(gen, [])
        return d

    d = started("Qwen2.5 Coder 1.5B Instruct GGUF")
    assert (d.FIRST, d.NEXT, d.RANK) == qwen[:3] and d.max_ngram == len(qwen.first)
    assert sum(len(v) for v in d.openings.values()) == len(qwen.openings)
    d = started("SmolLM2-135M-Instruct")
    assert (d.FIRST, d.NEXT, d.RANK) == (NgramTreeDrafter.FIRST, NgramTreeDrafter.NEXT, NgramTreeDrafter.RANK)
    assert d.max_ngram == len(NgramTreeDrafter.FIRST)
    own = NgramTables((0.3, 0.5), (0.6, 0.7), (1.0, 0.5))
    d = started("Qwen2.5 Coder 1.5B Instruct GGUF", tables=own, max_ngram=4)  # given tables win
    assert (d.FIRST, d.NEXT, d.RANK) == own[:3] and d.max_ngram == 4 and d.openings == {}


def test_counts_and_simulation_on_a_copied_sequence():
    # The output copies the prompt's run 10..17 and then leaves it (99).
    prompt = [1, 10, 11, 12, 13, 14, 15, 16, 17, 2, 10]
    seqs = [{"prompt": prompt, "output": [11, 12, 13, 14, 99], "category": "edit"}]
    counts = count_matches(seqs, max_ngram=3, depth=8)
    # Roots 10, 11, 12, 13 each have one earlier occurrence, of match length 1, 2, 3, 3 (capped),
    # whose next token is the emitted one; root 14 (m = 3) predicts 15, but 99 came.
    assert counts["first"] == [[1, 1], [1, 1], [2, 3]]
    # Continuations: from root 10, 11 12 13 14 right then 15 != 99 (4 tries past the first, 3 hits) ...
    assert counts["next"][0] == [3, 4]
    tables = tables_from_counts(counts, NgramTables((0.5,), (0.5,), (1.0, 0.5)), strength=0.0)
    assert tables.first == (1.0, 1.0, round(2 / 3, 3)) and tables.next[0] == 0.75
    free = StepCost({1: {1: 1.0, 64: 1.0}})  # extra rows cost nothing: draft everything
    sim = simulate(NgramTables((0.9,), (0.9,), (1.0,)), seqs, free)
    # One step accepts 11 12 13 14 and emits 99 after them: 5 tokens in one step of cost 1.
    assert sim["steps"] == 1 and sim["mean_accepted_length"] == 5 and sim["tokens_per_cost"] == 5


def test_held_out_prompts_skip_rows_of_the_file(tmp_path):
    """``--skip-rows`` counts rows of the file: two prompts a code-task row (completion, edit),
    one a Spec-Bench row; blank lines are not rows."""
    class Chat:
        def chat_prompt(self, text):
            return [len(text)]

    spec = tmp_path / "spec.jsonl"
    spec.write_text("\n".join(json.dumps({"question_id": 10 + i, "category": "qa", "turns": [f"q{i}"]})
                               for i in range(5)) + "\n\n")
    code = tmp_path / "code.jsonl"
    code.write_text("\n".join(json.dumps({"task_id": f"T/{i}", "prompt": "def f():\n", "canonical_solution": "  pass\n",
                                          "entry_point": "f"}) for i in range(4)))
    assert [p["row"] for p in load_prompts(str(spec), 0, Chat())] == [0, 1, 2, 3, 4]
    assert [p["id"] for p in held_out_prompts(load_prompts(str(spec), 0, Chat()), 2, 2)] == [12, 13]
    assert [p["id"] for p in held_out_prompts(load_prompts(str(code), 0, Chat()), 3, 9)] == ["T/3:completion", "T/3:edit"]
    assert held_out_prompts(load_prompts(str(spec), 0, Chat()), 9, 4) == []


FREE = StepCost({1: {1: 1.0, 64: 1.0}})  # extra rows cost nothing: every node is drafted
# Answers to prompts ending in (7, 8): three began 20 21 22, one 20 23; to prompts ending in 9: 30.
OPENINGS = (((7, 8), (20, 21, 22), 3), ((7, 8), (20, 23), 1), ((9,), (30,), 5))


def _with_openings(openings=OPENINGS, **kw):
    return NgramTreeDrafter(step_cost=FREE, tables=NgramTables(NgramTreeDrafter.FIRST, NgramTreeDrafter.NEXT,
                                                               NgramTreeDrafter.RANK, openings), **kw)


def _paths(c):
    def path(i):
        return path(c.parents[i]) + (c.tokens[i],) if i > 0 else ()
    return {path(i): round(p, 6) for p, i in c.ranked}


def test_answer_openings_are_drafted_after_their_prompt_end():
    d = _with_openings()
    prompt = [1, 2, 3, 7, 8]
    # At the answer's start: a prefix that c of the n = 4 openings begin with, c / (n + 1).
    assert _paths(d.candidates(prompt, 4, answer_start=5)) == {(20,): 0.8, (20, 21): 0.6, (20, 21, 22): 0.6,
                                                               (20, 23): 0.2}
    assert _paths(d.candidates(prompt, 2, answer_start=5)) == {(20,): 0.8, (20, 21): 0.6, (20, 23): 0.2}  # k deep
    # One token in, along the openings: their continuations, counted again.
    assert _paths(d.candidates(prompt + [20], 4, answer_start=5)) == {(21,): 0.6, (21, 22): 0.6, (23,): 0.2}
    assert _paths(d.candidates(prompt + [20, 21, 22], 4, answer_start=5)) == {}  # past every opening
    assert _paths(d.candidates(prompt + [25], 4, answer_start=5)) == {}  # the answer left them
    assert _paths(d.candidates([1, 2, 3, 7, 9], 4, answer_start=5)) == {(30,): round(5 / 6, 6)}  # another key
    assert _paths(d.candidates([1, 2, 3, 6, 8], 4, answer_start=5)) == {}  # no key ends this prompt
    assert _paths(d.candidates(prompt, 4)) == {}  # not told where the answer starts: lookup alone
    assert _paths(_with_openings(max_nodes=3).candidates(prompt, 4, answer_start=5)) == {(20,): 0.8, (20, 21): 0.6}
    # Two more answers began with 20 and went on in ways too rare to keep: they count in n.
    d = _with_openings(OPENINGS + (((7, 8), (20,), 2),))
    assert _paths(d.candidates(prompt, 4, answer_start=5)) == {(20,): round(6 / 7, 6), (20, 21): round(3 / 7, 6),
                                                               (20, 21, 22): round(3 / 7, 6), (20, 23): round(1 / 7, 6)}
    assert _paths(d.candidates(prompt + [20], 4, answer_start=5)) == {(21,): round(3 / 7, 6), (21, 22): round(3 / 7, 6),
                                                                      (23,): round(1 / 7, 6)}


def test_answer_start_is_found_from_the_openings_keys():
    """For a caller not told the prompt's length (vLLM's proposer): the latest position after
    a key, at least one answer token in and fewer than the longest opening's 3 (where
    ``candidates`` drafts openings)."""
    d = _with_openings()
    prompt = [1, 2, 3, 7, 8]
    for answered in ([20], [20, 21], [25, 26]):
        assert d.answer_start(prompt + answered) == 5
    assert d.answer_start(prompt + [20, 21, 22]) is None  # past the longest opening
    assert d.answer_start(prompt) is None  # no answer token yet
    assert d.answer_start([1, 2, 7, 9, 30]) == 4  # the other key
    assert d.answer_start([7, 8, 20, 7, 8, 21]) == 5  # the latest key
    assert d.answer_start([1, 2, 3, 6, 8, 20]) is None  # no key
    assert NgramTreeDrafter().answer_start(prompt + [20]) is None  # tables without openings


def test_answer_openings_and_lookup_combine_as_a_noisy_or():
    """A node both predict: 1 - (1 - lookup's p * the request's scale) (1 - the opening's p).
    The request's scale is scored on the lookup's own most probable node only."""
    d = _with_openings()
    prompt = [7, 8, 20, 5, 7, 8]  # the last two tokens occurred before, followed by 20
    lookup = d.candidates(prompt, 1, scale=0.5)  # (answer_start not given)
    (p_lookup, _), = lookup.ranked
    both = d.candidates(prompt, 1, scale=0.5, answer_start=len(prompt))
    assert _paths(both) == {(20,): round(1 - (1 - p_lookup) * (1 - 0.8), 6)}
    assert both.guess == lookup.guess == (20, p_lookup / 0.5)
    r = SimpleNamespace(rid=0, tokens=[1, 2, 3, 7, 8], prompt=[1, 2, 3, 7, 8])
    d.admit(None, [r])
    c = d.request_candidates(r, 4)
    assert c.guess == () and d._guess[0] == (5, {})  # only the openings draft here: no evidence on the tables
    assert _paths(c)[(20,)] == 0.8 and {c.tokens[i] for i in c.opened} == {20, 21, 22, 23}
    d.promise(r, c, 2)
    assert 0 not in d._promised  # nor on what the drafted nodes deliver
    d.promise(r, lookup, 1)
    assert d._promised[0] == pytest.approx(p_lookup / d.scale(0))  # a step of lookup nodes alone is scored


def test_answer_openings_keep_greedy_output_exact():
    """Right openings are accepted in the first step; wrong ones cost rows, never tokens."""
    model = Llama.random(tiny_config(num_layers=2), seed=3)
    prompt = [5, 9, 14, 2, 33, 7]
    ar = Generator(model).generate([prompt], 12)[0]
    for opening, right in ((ar.output[:6], True), ([(t + 1) % 64 for t in ar.output[:6]], False)):
        d = _with_openings(((tuple(prompt[-2:]), tuple(opening), 4),))
        emitted = []
        spec = Generator(model, d, SpecSchedule("max")).generate([prompt], 12,
                                                                 on_tokens=lambda r, new: emitted.append(len(new)))[0]
        assert spec.output == ar.output
        assert emitted[0] == (7 if right else 1)  # the whole opening and the target's next token, or its own


def test_fit_counts_openings_by_prompt_end():
    seqs = [{"prompt": [1, 7, 8], "output": [20, 21, 22, 5]}, {"prompt": [2, 7, 8], "output": [20, 21, 22, 6]},
            {"prompt": [3, 7, 8], "output": [20, 23]}, {"prompt": [8], "output": [20]}, {"prompt": [7, 8], "output": []}]
    assert openings_from(seqs, key_tokens=2, opening_tokens=3, min_count=1) == [[[7, 8], [20, 21, 22], 2],
                                                                                 [[7, 8], [20, 23], 1]]
    # Cut where fewer than two answers share the tokens: 20 23 is kept as "began with 20".
    assert openings_from(seqs, key_tokens=2, opening_tokens=3, min_count=2) == [[[7, 8], [20, 21, 22], 2],
                                                                                 [[7, 8], [20], 1]]
    assert openings_from(seqs, key_tokens=2, opening_tokens=3, min_count=4) == []


def test_corrupt_openings_are_a_clear_error(tmp_path, monkeypatch):
    import specdec_kernels.drafting.ngram as ngram

    entry = {"first": [0.5], "next": [0.5], "rank": [1.0]}
    for bad in ([[[7], [], 1]], [[[7], [20], 0]], [["x", [20], 1]], [[[7], [20]]], [[[7], [-20], 1]]):
        path = tmp_path / "tables.json"
        path.write_text(json.dumps({"mymodel": dict(entry, openings=bad)}))
        monkeypatch.setattr(ngram, "NGRAM_TABLES_PATH", path)
        with pytest.raises(ValueError, match="opening"):
            ngram_tables_for("mymodel")


def test_openings_of_another_vocabulary_are_a_clear_error():
    model = Llama.random(tiny_config(num_layers=1), seed=0)  # 64 tokens
    d = _with_openings(((((1, 2), (20, 64), 4),)))
    with pytest.raises(ValueError, match="token id 64, outside the model's vocabulary of 64"):
        Generator(model, d, SpecSchedule("max")).generate([[3, 1, 2]], 4)


def test_fits_of_tables_and_of_openings_keep_each_other(tmp_path, monkeypatch):
    """A refit of the tables keeps the entry's openings, and ``--openings-only`` its tables
    (both from saved outputs: ``--reuse``)."""
    monkeypatch.setattr(fit, "RESULTS_DIR", tmp_path)
    prompt = [1, 10, 11, 12, 13, 14, 15, 16, 17, 2, 10]
    seqs = [{"id": i, "category": "edit", "prompt": prompt, "output": [11, 12, 13, 14, 99]} for i in range(3)]
    data = {"model": "M", "weights": "native", "prompts": "p.jsonl", "prompts_sha256": "0", "skip_rows": 40,
            "max_new_tokens": 5, "step_cost": StepCost({1: {1: 1.0, 64: 1.0}}).to_json(), "sequences": seqs}
    for name in ("outputs", "openings"):
        (tmp_path / f"ngram_{name}_m.json").write_text(json.dumps(data))
    out = tmp_path / "tables.json"
    args = ["--model", "m", "--prompts", "unused.jsonl", "--reuse", "--out", str(out), "--opening-key", "2"]
    assert fit.main(args) == 0
    assert "openings" not in json.loads(out.read_text())["m"]  # tables alone
    assert fit.main(args + ["--openings-only", "--overwrite"]) == 0
    entry = json.loads(out.read_text())["m"]
    assert entry["openings"] == [[[2, 10], [11, 12, 13, 14, 99], 3]] and entry["first"]
    out.write_text(json.dumps({"m": dict(entry, first=[0.5] * len(entry["first"]))}))
    assert fit.main(args + ["--overwrite"]) == 0  # a refit of the tables
    again = json.loads(out.read_text())["m"]
    assert again["openings"] == entry["openings"] and again["openings_source"] == entry["openings_source"]
    assert again["first"] == entry["first"]
