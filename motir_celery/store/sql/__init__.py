"""Every SQL statement of the package, one module per audience (the catalogue: ``catalogue()``)."""
