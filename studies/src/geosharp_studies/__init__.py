"""The research studies of geosharp, built on its public API: the diagonal network
(:mod:`.diagonal`), the two-parameter toy model (:mod:`.toy`), model zoos (:mod:`.zoo`),
the paper's experiments (:mod:`.paper`), radius pilots (:mod:`.pilot`), and the statistics
and endpoints they report with (:mod:`.stats`, :mod:`.design`, :mod:`.endpoints`).
Their commands join the ``geosharp`` command line (``geosharp study ...``,
``geosharp zoo ...``) when this package is installed."""
