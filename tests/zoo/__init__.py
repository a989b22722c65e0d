"""The model zoo: every algorithm, default settings, models nobody tuned for (issue 12).

:mod:`zoo.models` holds the models and their references (:mod:`zoo.real_models`: the real-model
tier, published models on real data with committed NUTS references), :mod:`zoo.worker` runs one
(model, algorithm, dtype) in a child process, :mod:`zoo.harness` enforces the time budget
and classifies the outcome, ``tools/zoo_table.py`` writes the table of ``docs/guide/zoo.md``.
"""
