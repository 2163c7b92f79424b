"""The judge: a stage's window judged on distributions, with a confidence, as Kayenta does.

`migration.judge_spec` reads a plan's `judge:` section (beside the plan, which reads it);
`statistics` compares one metric's two samples (scipy's tests), `samples` turns what a data
path measured into per-request samples, `score` turns the metrics' verdicts into a 0-100
score and a window verdict the controller obeys.
"""
