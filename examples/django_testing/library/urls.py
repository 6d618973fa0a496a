from django.urls import path
from loans import views

urlpatterns = [
    path("borrow/", views.borrow),
    path("loans/<int:loan_id>/", views.show),
]
