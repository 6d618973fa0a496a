import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Book",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("title", models.CharField(max_length=200)),
                ("copies", models.PositiveIntegerField(default=1)),
            ],
        ),
        migrations.CreateModel(
            name="Loan",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("reader", models.CharField(max_length=100)),
                ("borrowed_at", models.DateTimeField(auto_now_add=True)),
                ("receipt", models.CharField(blank=True, max_length=300)),
                ("overdue", models.BooleanField(default=False)),
                ("book", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="loans",
                                           to="loans.book")),
            ],
        ),
    ]
