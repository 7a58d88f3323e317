"""`cupy-llama bench`: the standard workloads (workloads.py), the engine measured offline
(offline.py) and through a server (serve.py), transformers as the baseline (hf.py), the
report (report.py), and the random-weight models they run (random_model.py)."""
