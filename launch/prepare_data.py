"""Tokenize a config's data.source into cached token shards ahead of a run (a run prepares them itself
when they are missing; data/prepare.py says what is cached and under which key).

    python launch/prepare_data.py --config gpt_1.3b_8k.yaml data.source=[/data/my_corpus] data.num_proc=16

It prints the summary (documents, tokens, the cache folder). A bad config or bad data ends with one
line and exit code 2, as launch/train.py does.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import List, Optional

if __package__ in (None, ""):  # run as a script: make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.prepare import prepare  # noqa: E402
from data.sources import DataError  # noqa: E402
from training.config import ConfigError, load_config  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Tokenize data.source into cached token shards.")
    ap.add_argument("--config", default=None, help="configs/NAME.yaml (or a path)")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. data.tokenizer_vocab_size=8192")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        print(prepare(cfg.data, cfg.model.vocab_size).summary())
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
