"""Settings: one typed tree (``settings``), where each value comes from (``sources``: flags,
``TANDEM_*`` variables, a YAML file, defaults) and the named choices they accept (``choices``).
"""
