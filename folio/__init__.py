"""The composition root: the `folio` command line (folio/cli.py), the one package that may import
every other (common, engine, services, gateway, bench) to wire them into processes. Nothing else
lives here, and no other package imports it.
"""
