"""The table of RESULTS.md "What should I use under staleness?" (issue 46): every arm of the three staleness settings
at its own best learning rate, picked on k = 0, read from the committed cells named in what_to_use.json:

    PYTHONPATH=src python benchmarks/staleness/what_to_use.py benchmarks/staleness/what_to_use.json

How the rate and the best arm are picked: vcpo.study.choice.
"""

from vcpo.study.choice import main

if __name__ == "__main__":
    main()
