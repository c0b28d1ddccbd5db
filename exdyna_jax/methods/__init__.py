"""One module per method (ExDyna in its own folder), and the registry that names them."""
