"""The judge: a stage's window judged on distributions, with a confidence, as Kayenta does.

`spec` reads a plan's `judge:` section, `statistics` compares one metric's two samples (scipy's
tests), `samples` turns what a data path measured into per-request samples, `score` turns the
metrics' verdicts into a 0-100 score and a window verdict the controller obeys.
"""
