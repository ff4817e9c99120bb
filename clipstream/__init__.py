"""clipstream: continual vision-language pretraining.

Ground floor (this folder): `settings`, `registry`, `index`, `models`, the generated `v1` stubs. On it stand
`clipstream.training` and `clipstream.services`; on top, the `cli` and the pipelines joining both sides
(`indexing`, `promotion`, `clipstream.benchmarks`).
"""
