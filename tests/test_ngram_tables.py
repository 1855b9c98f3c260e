"""Per-model acceptance tables of the prompt-lookup tree (NgramTreeDrafter) and the script
that measures them (bench/fit_ngram_tables.py)."""
import json
from types import SimpleNamespace

import pytest

from bench.bench_e2e import load_prompts
from bench.fit_ngram_tables import count_matches, held_out_prompts, simulate, tables_from_counts
from specdec_kernels.decoding.cost_model import StepCost
from specdec_kernels.drafting.ngram import NGRAM_TABLES_PATH, NgramTables, NgramTreeDrafter, ngram_tables_for


def test_tables_are_found_by_model_name():
    entries = json.loads(NGRAM_TABLES_PATH.read_text())
    assert "qwen2.5-coder-1.5b" in entries
    entry = entries["qwen2.5-coder-1.5b"]
    tables = ngram_tables_for("Qwen2.5 Coder 1.5B Instruct GGUF")  # the loaded model's name
    assert tables == NgramTables(tuple(entry["first"]), tuple(entry["next"]), tuple(entry["rank"]))
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
    assert (d.FIRST, d.NEXT, d.RANK) == qwen and d.max_ngram == len(qwen.first)
    d = started("SmolLM2-135M-Instruct")
    assert (d.FIRST, d.NEXT, d.RANK) == (NgramTreeDrafter.FIRST, NgramTreeDrafter.NEXT, NgramTreeDrafter.RANK)
    assert d.max_ngram == len(NgramTreeDrafter.FIRST)
    own = NgramTables((0.3, 0.5), (0.6, 0.7), (1.0, 0.5))
    d = started("Qwen2.5 Coder 1.5B Instruct GGUF", tables=own, max_ngram=4)  # given tables win
    assert (d.FIRST, d.NEXT, d.RANK) == own and d.max_ngram == 4


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
