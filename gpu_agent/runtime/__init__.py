"""The standalone GPU agent runtime. Imports no Django and no control-plane app."""
