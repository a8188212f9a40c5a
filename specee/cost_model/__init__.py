"""The cost model: a run's work, counted exactly from its step traces, priced with unit costs
measured on this machine (or an analytic GPU table) — the modelled speedup beside the measured one.

- ``priced_work``: what a mode's steps cost in units (layers, LM heads, predictor calls, draft
  steps, host reads), the unit prices measured interleaved after the clock, counts x prices, the
  gap to the layer ratio, and the same counts priced for Llama-2 on an analytic GPU;
- ``block_costs``: the block-cost table c(n) of one verification forward over n tokens, which
  prices proposal methods (prompt lookup) and sizes their settings;
- ``speed_job``: a speed job's cost model, from its traces and its own measured prices.
"""
