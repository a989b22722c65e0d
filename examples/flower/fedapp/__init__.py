"""A Flower app of numpyro_fed: the model, the nodes' loader and the methods (task.py), the
ServerApp (server_app.py) and the ClientApp (client_app.py)."""
