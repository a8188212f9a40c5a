"""Speed at a loss budget: every exit policy's speed–quality frontier, the oracle's, and an
operating point chosen with a statistical guarantee (``experiment=frontier``).

- :mod:`record`: one teacher-forced pass per request under dense's trajectory records, at every
  layer, the full-vocabulary argmax, the draft's speculative set, each predictor bank's logit,
  AdaInfer's scores and the log-probability of the scored token;
- :mod:`replay`: any operating point's exits replayed from those records (schedule included),
  with its work counts for the cost model, and the oracle;
- :mod:`calibrate`: Learn-then-Test fixed-sequence testing (exact binomial, Hoeffding–Bentkus);
- :mod:`pages`: the frontier figure, the budget table and the joint verdict.
"""
