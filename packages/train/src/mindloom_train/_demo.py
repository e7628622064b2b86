"""`mindloom demo`: the README's main job on the bundled corpus, end to end.

clean (mindloom-data) -> train a BPE tokenizer (mindloom-tokenizer) -> tokenize and pack
(mindloom-data) -> train a small Llama on the CPU (this package) -> checkpoint -> sample
text and held-out perplexity. The run directory is what mindloom-monitor opens.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

_DEMO_MARKER = ".mindloom-demo"


def _say(msg: str) -> None:
    print(f"demo: {msg}", flush=True)


# Tiny Shakespeare's paragraphs are mostly short speeches, which the default length
# filter (50 units) drops: 85% of the corpus. The demo keeps them: the more text, the
# later a small model starts to memorise it.
CLEAN_CONFIG = {"filters": {"length": {"min_units": 3}}}


def _clean(corpus: Path, out: Path) -> str:
    """Clean and dedup the corpus with mindloom-data; returns a glob of the cleaned shards."""
    from mindloom_data import CleanError, clean

    _say(f"stage 1/5 clean: mindloom-data clean {corpus} --output {out}")
    t0 = time.perf_counter()
    try:
        report = clean([str(corpus)], out, config=CLEAN_CONFIG, progress=False)
    except CleanError as exc:
        raise SystemExit(f"error: demo: mindloom-data clean failed: {exc}") from None
    shards = sorted(out.glob("shard-*.parquet"))
    if not shards:
        raise SystemExit(f"error: demo: mindloom-data clean wrote no shards in {out}")
    kept = report["output"]["documents"]
    read = report["read"]["documents"]
    _say(
        f"  kept {kept} of {read} documents in {len(shards)} shard(s) "
        f"({time.perf_counter() - t0:.1f}s, report {out / 'report.json'})"
    )
    return str(out / "shard-*.parquet")


def demo_config(run_dir: Path, text_input: str, quick: bool, minutes: float) -> dict:
    """The demo run: `train_iters` fill about 3 minutes of a quiet 2-core machine and
    `minutes` ends it sooner on a busy one. Held-out loss must fall at every evaluation,
    so the model never goes over its training text more than about 3 times (1200 steps x
    8 x 128 tokens over the ~440k-token training split; dropout 0.1, weight decay 0.1,
    cosine decay). The old 1500 x 16 x 128 went over the then-filtered 186k-token split
    up to 10 times and held-out loss rose after step 600. `quick` is step-bounded only
    (its test must behave the same on any machine)."""
    if quick:
        model = {"preset": "debug", "vocab_size": None}
        seq, iters, gbs, vocab, eval_iters, every = 64, 30, 8, 512, 4, 10
    else:
        model = {
            "preset": "debug",
            "vocab_size": None,
            "hidden_size": 128,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 4,
            "ffn_hidden_size": 384,
            "dropout": 0.1,
        }
        seq, iters, gbs, vocab, eval_iters, every = 128, 1200, 8, 1024, 16, 100
    split = {
        "text_input": text_input,
        "txt_mode": "paragraph",
        "append_eos": True,
        # paragraphs start with the speaker, as the sample's prompt does: BOS marks
        # "a new paragraph starts here" for training, evaluation and generation alike
        "append_bos": True,
        "seq_length": seq,
    }
    return {
        "model": model,
        "tokenizer": {"train_input": text_input, "model_type": "bpe", "vocab_size": vocab},
        "train_dataset": {**split, "doc_range": [0.0, 0.9]},
        "eval_dataset": {**split, "doc_range": [0.9, 1.0]},
        "training": {
            "train_iters": iters,
            "global_batch_size": gbs,
            "micro_batch_size": gbs,
            "eval_interval": every,
            "eval_iters": eval_iters,
            "time_limit_s": None if quick else minutes * 60.0,
        },
        "optimizer": {"beta2": 0.99, "weight_decay": 0.1},
        "lr_scheduler": {
            "type": "cosine",
            "lr": 2.0e-3,
            "min_lr": 2.0e-4,
            "warmup_iters": max(iters // 20, 1),
        },  # fmt: skip
        # checkpoints at evaluation steps, all kept: `--checkpoint best` can pick any
        "checkpoint": {
            "save_interval": every * (1 if quick else 3),
            "keep_last": iters // every + 1,
        },  # fmt: skip
        "monitor": {"log_interval": 5 if quick else 25},
        "seed": 1234,
        "run_dir": str(run_dir),
    }


def run_demo(run_dir: Path, quick: bool = False, minutes: float = 3.0) -> int:
    from mindloom_data import bundled_corpus

    from mindloom_train import (
        Trainer,
        dump_config,
        from_dict,
        load_model,
        read_tracker,
        sample_text,
        tokenizer_dir,
    )

    t_all = time.perf_counter()
    if run_dir.exists():
        # A demo is a fresh run, so an old demo is replaced; anything else is not ours to delete.
        if not (run_dir / _DEMO_MARKER).exists() and any(run_dir.iterdir()):
            print(
                f"error: demo: {run_dir} exists and is not a previous demo run; "
                "pass another --run-dir",
                file=sys.stderr,
            )
            return 2
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / _DEMO_MARKER).write_text(
        "written by `mindloom demo`; the next demo may replace this directory\n"
    )
    corpus = bundled_corpus()
    _say(f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.2f} MB, tiny Shakespeare)")
    text_input = _clean(corpus, run_dir / "cleaned")

    cfg = from_dict(demo_config(run_dir, text_input, quick, minutes))
    cfg_path = run_dir / "demo-config.yaml"
    cfg_path.write_text(dump_config(cfg))
    _say(f"stage 2/5 tokenizer: BPE, {cfg.tokenizer.vocab_size} ids (mindloom-tokenizer)")
    _say(
        "stage 3/5 tokenize + pack: Megatron .bin/.idx, 90/10 documents train/held-out (mindloom-data)"
    )
    budget = "a few seconds" if quick else f"up to {minutes:g} min"
    _say(f"stage 4/5 train: a small Llama on the CPU for {budget} (config {cfg_path})")
    trainer = Trainer(cfg, console=sys.stdout)
    code = trainer.run()
    if code != 0:
        print(
            f"error: demo: training failed (exit {code}); see {run_dir / 'train.log'}",
            file=sys.stderr,
        )
        return code
    save_path = cfg.save_path
    step = read_tracker(save_path)
    _say(f"stage 5/5 checkpoint + sample: {save_path} (latest step {step})")
    model, ckpt = load_model(save_path)
    from mindloom_tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_dir(cfg))
    contract = ckpt.common.get("data_contract")
    text = sample_text(
        model, tok, "ROMEO:", 120 if not quick else 40, temperature=0.8, top_k=50, seed=0,
        contract=contract, on_ids=lambda _ids, note: _say(f"  {note}"),
    )  # fmt: skip
    print("\n----- sample (prompt 'ROMEO:') -----")
    print(text)
    print("------------------------------------")
    if trainer.last_eval is not None:
        loss, ppl = trainer.last_eval
        print(f"held-out loss {loss:.4f}, perplexity {ppl:.2f} (step {trainer.step})")
        print(f"best checkpoint: mindloom generate --checkpoint {save_path}/best --prompt ...")
    print(f"run directory: {run_dir}  (watch it: mindloom-monitor {run_dir})")
    print(f"demo finished in {time.perf_counter() - t_all:.0f}s")
    return 0
