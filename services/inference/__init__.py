"""Inference: the model behind a servicer, decoding with continuous batching.

Modules: `service` (the `spine.v1.Inference` servicer), `config` (the `inference:` section),
`steps` (the model's step in the request path), `scheduler` (one thread owns the engine; jobs
join and leave between decode steps), `models` (several models in one component), `priority`
(queue classes with aging), `cost` and `load_hints` (what a token costs now, and the load hint
every answer carries), `serving_metrics` and `gpu_metrics` (what the model server exports),
`system_prompt`, `output_policy`, `cpu_placement`; `model/` holds the backends (the built-in
tiny LM, Hugging Face models, the `sim` device-time model), the KV pool and the tokenizer.
"""
