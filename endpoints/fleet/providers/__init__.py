"""Machine providers for node pools (`base.Provider`): `local`, `ec2`, `kubernetes`."""
