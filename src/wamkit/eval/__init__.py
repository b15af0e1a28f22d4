"""Pipelined closed-loop evaluation: N envs in P stages over local or Ray workers, results you can trust.

- :func:`wamkit.eval.runner.run_eval` runs an evaluation (what ``wamkit eval`` calls);
- :mod:`~wamkit.eval.journal` keeps one fsynced JSON line per finished episode (``--resume``);
- :mod:`~wamkit.eval.success` has the success rates with Wilson 95% intervals;
- :mod:`~wamkit.eval.scheduler` is the pipeline, :mod:`~wamkit.eval.executors` the workers;
- :mod:`~wamkit.eval.report` writes summary.json, results.md and the plots.

The evaluator reaches a model only through the OpenPI websocket protocol (:mod:`wamkit.serve.client`).
"""
