"""The API's tokens were rest_framework.authtoken's, stored in plain text in `authtoken_token`;
they are knox's now (hashed, expiring: teams/tokens.py). The old table and every token in it go:
finance makes new tokens with `manage.py api_token create`."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("teams", "0001_initial")]

    operations = [
        migrations.RunSQL(
            "DROP TABLE IF EXISTS authtoken_token",
            reverse_sql=migrations.RunSQL.noop,
        ),
    ]
