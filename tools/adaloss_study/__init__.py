"""The study: where adaptive loss scaling beats global scaling, and at what cost.

``adaloss-study`` (:mod:`adaloss_study.cli`) trains small models in fp32 and in
fp16 under each scaling method and reports losses, skipped steps, per-layer
underflow and step time.
"""
