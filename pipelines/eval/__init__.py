"""``graphmax eval``: the paper's experiments re-measured on held-out text, written to a report folder.

corpus → split by document (seed) → graph from the training side only →
held-out side halved into validation (tuning context-aware graphmax) and test
(everything reported) → perplexity, generation metrics, solver traces, figures,
``report.md`` with verdicts, and a blind A/B sheet.

One module per concept, each importing only those listed before it: ``data`` (the split and the graph),
``baselines`` (the kNN datastore, fine-tuning, the few-shot prompt), ``roster`` (the decoders, one typed record
each), ``scoring`` (perplexity and generation per decoder), ``probes`` (solver traces, top tokens, the figures),
``report`` (``report.md``, the CSVs, the A/B sheet, from one ``Results`` record), ``experiment`` (the run, from
the split to the report) and ``cli`` (the command's options, checks and report folder).
"""

from .cli import register, run

__all__ = ["register", "run"]
