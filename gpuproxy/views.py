from django.http import HttpResponse


def health(request):
    return HttpResponse("OK")


running = load_model = unload_all = unload_model = unload_all_legacy = logs = health
