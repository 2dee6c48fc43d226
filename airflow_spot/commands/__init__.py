"""``airflow-spot`` subcommands that need the Airflow layer (an AWS connection, the metadata database)."""
