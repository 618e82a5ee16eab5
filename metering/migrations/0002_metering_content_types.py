"""The moved models' content types follow them: `billing.sample` becomes `metering.sample`.

A rename of the rows in place, so that what refers to them by id (permissions, the admin's
log entries, anything storing a content type) keeps working. Should the new app's rows exist
already (Django creates them after a `migrate` that stopped between this app's migrations),
they, never used, give way to the old ones.
"""

from django.db import migrations

MODELS = (
    "agenttoken",
    "sample",
    "unknowndevicesample",
    "miginstance",
    "dcgminstance",
    "dirtyhour",
    "rollupprogress",
    "usagehour",
)


def _rename(apps, schema_editor, old: str, new: str) -> None:
    content_types = apps.get_model("contenttypes", "ContentType").objects.db_manager(
        schema_editor.connection.alias
    )
    for model in MODELS:
        if not content_types.filter(app_label=old, model=model).exists():
            continue
        content_types.filter(app_label=new, model=model).delete()
        content_types.filter(app_label=old, model=model).update(app_label=new)
    content_types.clear_cache()


def forwards(apps, schema_editor) -> None:
    _rename(apps, schema_editor, "billing", "metering")


def backwards(apps, schema_editor) -> None:
    _rename(apps, schema_editor, "metering", "billing")


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0001_metering_models"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("admin", "0003_logentry_add_action_flag_choices"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
