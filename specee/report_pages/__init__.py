"""The report's pages, by what they are drawn from: speed results (speed.py), exit statistics and
potential (exits.py), accuracy, verdicts and the paper's own figures (claims.py); what every page
calls a result and where it sorts (catalogue.py). specee/report.py assembles them."""
